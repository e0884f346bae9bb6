"""bench scale's simulation of partitioned admission: deterministic, never over the total
(also while the coordinator fails over), and partitions that do not share a key commit apart."""

from __future__ import annotations

import pytest

from natsched.cli.app import main
from natsched.sim.scale import ScaleBenchSettings, ScaleSettings, ScaleSim, run_scale_benchmark, scale_table

FAIR = dict(total=100_000, hold_s=1.0, batch=16, duration_s=3.0, warmup_s=0.5)


def test_the_same_seed_gives_the_same_run():
    a = ScaleSim(ScaleSettings(partitions=2, duration_s=1.5, warmup_s=0.5)).run()
    b = ScaleSim(ScaleSettings(partitions=2, duration_s=1.5, warmup_s=0.5)).run()
    assert a == b


def test_two_replicas_on_one_key_lose_races_and_two_partitions_do_not_share_theirs():
    one = ScaleSim(ScaleSettings(partitions=1, replicas=2, duration_s=1.5, warmup_s=0.5)).run()
    two = ScaleSim(ScaleSettings(partitions=2, replicas=2, duration_s=1.5, warmup_s=0.5)).run()
    alone = ScaleSim(ScaleSettings(partitions=1, replicas=1, duration_s=1.5, warmup_s=0.5)).run()
    assert one.conflicts_per_commit > 0.1 and alone.conflicts_per_commit == 0
    assert two.commits_per_s > 1.8 * one.commits_per_s  # separate keys, separate stream leaders


def test_one_server_bounds_what_partitions_add():
    spread = ScaleSim(ScaleSettings(partitions=8, duration_s=1.5, warmup_s=0.5)).run()
    shared = ScaleSim(ScaleSettings(partitions=8, servers=1, cores=1, duration_s=1.5, warmup_s=0.5)).run()
    assert shared.commits_per_s < 0.8 * spread.commits_per_s


@pytest.mark.parametrize("partitions", [1, 3, 4])
def test_floors_hold_and_nothing_is_over_admitted_also_through_a_coordinator_failover(partitions):
    r = ScaleSim(ScaleSettings(partitions=partitions, kill_coordinator_at=1.0, lease_s=1.0, **FAIR)).run()
    assert r.max_held_ratio <= 1.0
    assert r.floor_ratio > 0.9
    assert r.plans >= 2


@pytest.mark.parametrize("bad, match", [
    (dict(partitions=0), "partitions"), (dict(replicas=0), "replicas"), (dict(servers=0), "servers"),
    (dict(floors=100, tenants=10), "floors"), (dict(duration_s=1.0, warmup_s=2.0), "warm-up"),
])
def test_bad_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ScaleSim(ScaleSettings(**bad))


def test_the_report_has_a_row_per_partition_count_and_efficiency_against_p1():
    report = run_scale_benchmark(ScaleBenchSettings(partitions=(1, 2), duration_s=1.5, kill_coordinator_at=0.8))
    assert [r["partitions"] for r in report["rows"]] == [1, 2]
    assert report["rows"][0]["scaling_spread"] == 1.0
    assert 0.8 < report["rows"][1]["scaling_spread"] <= 1.05
    text = scale_table(report)
    assert "commits/s" in text and text.count("\n") >= 4


def test_the_command_refuses_bad_partition_lists(capsys):
    assert main(["bench", "scale", "--partitions", "0,2"]) == 1
    assert "--partitions must be positive integers" in capsys.readouterr().err
