"""The capacity-following total: pure arithmetic."""

import pytest

from natsched.admitter.dynamic import CacheShare, DynamicTotal, DynamicTotalSettings, factor_ceiling
from natsched.admitter.leases import LeaseTracker


def make_dynamic(**kw) -> DynamicTotal:
    return DynamicTotal(DynamicTotalSettings(**kw))


def test_without_worker_capacity_the_configured_total_holds():
    assert make_dynamic().next_total(400_000, None, capacity=0, workers_used=0) == 400_000


def test_follows_capacity_and_never_exceeds_the_ceiling():
    d = make_dynamic()
    assert d.next_total(1_000_000, None, capacity=300_000, workers_used=200_000) == 300_000  # 67 %: hold
    assert d.next_total(200_000, None, capacity=300_000, workers_used=200_000) == 200_000
    assert d.next_total(1_000_000, 250_000, capacity=300_000, workers_used=200_000) == 250_000  # hard cap


def test_tightens_above_the_high_watermark_and_loosens_below_the_low():
    d = make_dynamic()
    tight = d.next_total(10**9, None, capacity=100_000, workers_used=95_000)
    assert tight == 90_000
    assert d.next_total(10**9, None, capacity=100_000, workers_used=95_000) == 81_000
    for _ in range(3):
        loose = d.next_total(10**9, None, capacity=100_000, workers_used=10_000)
    assert loose > tight


def test_factor_is_bounded():
    d = make_dynamic()
    for _ in range(100):
        d.next_total(10**9, None, capacity=100_000, workers_used=99_000)
    assert d.factor == 0.5
    for _ in range(100):
        d.next_total(10**9, None, capacity=100_000, workers_used=0)
    assert d.factor == 2.0


def test_with_reservations_the_factor_is_measured_not_stepped():
    d = make_dynamic(high=1.0)
    # the admitters book 2 runtime tokens per token the workers hold: the total may be twice the
    # capacity (aimed at full here); the factor goes halfway there per interval
    assert d.next_total(10**9, None, capacity=100_000, workers_used=30_000, reserved=60_000) == 150_000
    for _ in range(10):
        total = d.next_total(10**9, None, capacity=100_000, workers_used=30_000, reserved=60_000)
    assert total == pytest.approx(200_000, rel=0.01)
    # overloaded workers (queued prefill counted) hold more than was booked: it tightens, bounded
    for _ in range(20):
        total = d.next_total(10**9, None, capacity=100_000, workers_used=200_000, reserved=50_000)
    assert d.factor == 0.5 and total == 50_000
    assert d.next_total(10**9, None, capacity=100_000, workers_used=0, reserved=0) == 55_000  # AIMD as before


def _settle(d: DynamicTotal, share: float | None, reserved: int, used: int = 10_000, configured: int = 10**9) -> int:
    for _ in range(30):
        total = d.next_total(configured, None, capacity=100_000, workers_used=used, reserved=reserved,
                             cache_share=share)
    return total


def test_without_prefix_sharing_the_ceiling_stays_two():
    """Each prompt its own: a reservation books it at most twice, the ceiling is 2 as before."""
    assert factor_ceiling(DynamicTotalSettings(), None) == 2.0
    assert factor_ceiling(DynamicTotalSettings(), 0.0) == 2.0
    d = make_dynamic()
    assert _settle(d, 0.0, reserved=100_000) == 200_000 and d.factor == 2.0  # measured 10, held at 2
    assert _settle(make_dynamic(), None, reserved=100_000) == 200_000


def test_the_factor_aims_at_the_high_watermark_of_the_workers_not_at_full():
    """Their KV fills after the door lets a request in: a total aimed at full lets a surge through
    until the engines are past full. Used up at the settled factor, the total makes the workers hold
    ``high`` of their capacity (booked 3 per token held: the total is 0.8 x 3 x capacity)."""
    d = make_dynamic()
    total = _settle(d, 0.9, reserved=90_000, used=30_000)
    assert d.factor == pytest.approx(0.8 * 3.0, rel=0.01) and total == pytest.approx(240_000, rel=0.01)
    held_when_used_up = total / (90_000 / 30_000)  # runtime tokens booked per token held
    assert held_when_used_up == pytest.approx(0.8 * 100_000, rel=0.01)
    assert _settle(make_dynamic(high=0.9), 0.9, reserved=90_000, used=30_000) == pytest.approx(270_000, rel=0.01)


def test_with_80_percent_sharing_the_ceiling_rises_to_what_is_booked():
    """A prefix shared by many is held once but booked by every reservation: at h = 0.8 a
    booking ratio up to 2 / (1 - 0.8) = 10 is real, and the measured 8 is followed, not clamped."""
    assert factor_ceiling(DynamicTotalSettings(), 0.8) == pytest.approx(10.0)
    d = make_dynamic()
    assert _settle(d, 0.8, reserved=80_000) == pytest.approx(0.8 * 800_000, rel=0.01)  # x the watermark
    assert _settle(d, 0.8, reserved=200_000) == pytest.approx(1_000_000, rel=0.01)  # ratio 20: the ceiling 10
    # the sharing falls away: the factor comes down with the ceiling at once
    assert d.next_total(10**9, None, capacity=100_000, workers_used=10_000, reserved=200_000,
                        cache_share=0.0) == 200_000


def test_the_ceiling_is_bounded_and_never_above_the_configured_total():
    s = DynamicTotalSettings()
    assert factor_ceiling(s, 0.99) == s.factor_bound and factor_ceiling(s, 1.0) == s.factor_bound
    assert factor_ceiling(s, 5.0) == s.factor_bound and factor_ceiling(s, float("nan")) == 2.0
    d = make_dynamic()
    assert _settle(d, 1.0, reserved=10**7) == 100_000 * s.factor_bound
    assert _settle(d, 1.0, reserved=10**7, configured=300_000) == 300_000  # cluster.total rules
    assert d.next_total(10**9, 250_000, capacity=100_000, workers_used=10_000, reserved=10**7,
                        cache_share=1.0) == 250_000  # and cluster.hard_cap


def test_cache_share_is_the_decayed_hit_share_of_completions():
    c = CacheShare(half_life_s=30.0)
    assert c.share() is None
    c.observe(1000, 800, now=0.0)
    c.observe(1000, 800, now=0.0)
    assert c.share() == pytest.approx(0.8)
    c.observe(2000, 0, now=30.0)  # half a minute on, the old traffic weighs half
    assert c.share() == pytest.approx(800 / 3000)
    c.observe(1000, 5000, now=30.0)  # a worker's impossible count is clamped to its prompt
    c.observe(0, 50, now=30.0)  # and an empty prompt says nothing
    c.observe(1000, -7, now=30.0)
    assert c.share() == pytest.approx(1800 / 5000)
    c.observe(1000, 1000, now=10.0)  # out of order (two admitters' clocks): counted, nothing undecayed
    assert 0.0 <= c.share() <= 1.0 and c.at == 30.0


def test_bad_dynamic_bounds_are_refused():
    from natsched.admitter.knobs import SettingsError, _check_dynamic
    with pytest.raises(SettingsError, match="factor_bound"):
        _check_dynamic(DynamicTotalSettings(factor_bound=1.5))
    with pytest.raises(SettingsError, match="share_half_life_s"):
        _check_dynamic(DynamicTotalSettings(share_half_life_s=0))


def test_disabled_keeps_the_configured_total():
    assert make_dynamic(enabled=False).next_total(123, None, capacity=10**6, workers_used=0) == 123


def test_leases_expire_after_missed_heartbeats_and_report_what_they_held():
    leases = LeaseTracker(missed=3)
    leases.on_heartbeat("w1", now=0.0, interval=1.0, inflight=["a", "b"])
    leases.on_heartbeat("w2", now=0.0, interval=1.0, inflight=["c"])
    leases.on_heartbeat("w2", now=2.5, interval=1.0, inflight=["c"])
    assert leases.expired(2.9) == {}
    assert leases.expired(3.1) == {"w1": {"a", "b"}}
    assert leases.reported("c") and not leases.reported("a")


def test_a_pause_of_the_admitter_itself_does_not_expire_leases():
    """Heartbeats sent while this process could not run are still unread in its socket: the
    silence after its own pause is not the workers' (a starved machine once made an admitter
    rescue — run twice — the work of a live worker streaming a long answer)."""
    leases = LeaseTracker(missed=3, pause_s=0.5)
    leases.on_heartbeat("w1", now=0.0, interval=1.0, inflight=["a"])
    assert leases.expired(0.1) == {} and leases.paused_s == 0.0
    assert leases.expired(10.0) == {} and leases.paused_s == pytest.approx(9.9)  # our own pause
    assert all(leases.expired(10.0 + k / 10) == {} for k in range(1, 30))  # still silent, for 2.9 s of listening
    assert leases.paused_s == 0.0
    assert leases.expired(13.1) == {"w1": {"a"}}  # 3.1 s heard nothing: expired


def test_the_time_the_admitter_was_disconnected_does_not_expire_leases():
    """Heartbeats are core NATS: those sent while this process's connection is down (a
    nats-server restarting) are lost, and the workers, alive all along, reconnect too. Judged
    by that silence, a server restart made every worker look dead and its work run twice."""
    leases = LeaseTracker(missed=3, pause_s=0.5)
    leases.on_heartbeat("w1", now=0.0, interval=1.0, inflight=["a"])
    assert all(leases.expired(k / 10) == {} for k in range(1, 10))
    assert all(leases.expired(1.0 + k / 10, listening=False) == {} for k in range(40))  # 4 s down
    assert leases.deaf and "w1" in leases.workers
    assert all(leases.expired(5.0 + k / 10) == {} for k in range(30))  # back at 5.0: 2.9 s of listening
    assert not leases.deaf and leases.listening_since == 5.0
    assert leases.expired(8.1) == {"w1": {"a"}}  # 3.1 s heard nothing since the reconnect: expired


def test_a_heartbeat_after_the_reconnect_keeps_the_lease():
    leases = LeaseTracker(missed=3, pause_s=0.5)
    leases.on_heartbeat("w1", now=0.0, interval=1.0, inflight=["a"])
    assert all(leases.expired(k / 10, listening=k < 10) == {} for k in range(1, 60))  # down from 1.0 to 6.0
    leases.on_heartbeat("w1", now=6.5, interval=1.0, inflight=["a"])
    assert all(leases.expired(6.0 + k / 10) == {} for k in range(1, 35))
    assert leases.reported("a")


def test_heartbeats_read_after_a_pause_keep_the_lease():
    leases = LeaseTracker(missed=3, pause_s=0.5)
    leases.on_heartbeat("w1", now=0.0, interval=1.0, inflight=["a"])
    leases.expired(0.1)
    assert leases.expired(8.0) == {}
    leases.on_heartbeat("w1", now=8.01, interval=1.0, inflight=["a"])  # the backlog, read at last
    assert all(leases.expired(8.0 + k / 10) == {} for k in range(1, 30))
    assert leases.reported("a")
