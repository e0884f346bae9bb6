"""The worker's bounded memory of recent request ids."""

from natsched.workers.recent import RecentIds


def test_ids_are_forgotten_by_age_and_by_count():
    ids = RecentIds(max_age_s=10.0, max_size=3)
    for i, t in enumerate((100.0, 101.0, 102.0)):
        ids.add(f"r{i}", now=t)
    ids.add("r3", now=103.0)  # over the size: the oldest goes
    assert len(ids) == 3
    ids.add("r4", now=112.5)  # r1 (101) and r2 (102) are older than 10 s by now
    assert [r for r in ("r0", "r1", "r2", "r3", "r4") if r in ids._seen] == ["r3", "r4"]


def test_adding_again_refreshes_an_id():
    ids = RecentIds(max_age_s=10.0, max_size=2)
    ids.add("a", now=0.0)
    ids.add("b", now=1.0)
    ids.add("a", now=2.0)  # now the newest
    ids.add("c", now=3.0)
    assert "b" not in ids._seen and "a" in ids._seen and "c" in ids._seen
