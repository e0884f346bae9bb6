"""The partitioned benchmarks' own parts: one tenant per partition for the pipeline's load, and
the shared-state benchmark committing to each partition's own bucket without losing an update."""

from natsched.admitter.budget import partition_of
from natsched.bench.pipeline import bench_tenants
from natsched.bench.shared import measure


def test_the_pipeline_load_has_one_tenant_in_each_partition():
    assert bench_tenants(1) == ["bench"]  # as before partitions
    for p in (2, 3, 8):
        tenants = bench_tenants(p)
        assert [partition_of(t, p) for t in tenants] == list(range(p))


async def test_shared_state_commits_to_each_partitions_bucket_and_loses_nothing(bus, nats_url):
    row = await measure(nats_url, replicas=4, seconds=0.5, partitions=2)
    assert row["partitions"] == 2 and row["commits"] > 0
    assert row["lost_updates"] == 0 and row["final_used"] == row["commits"]
    assert len(row["used_per_partition"]) == 2 and min(row["used_per_partition"]) > 0  # both keys committed to


def test_bench_partitions_decides_every_request_with_real_admitter_processes():
    from natsched.bench.partitions import run_admission

    row = run_admission(partitions=2, requests=200)
    assert row["decided"] == 200 and row["decisions_per_s"] > 0
    assert {"admitter-p0", "admitter-p1", "nats-server"} <= set(row["cpu_ms_per_decision"])
