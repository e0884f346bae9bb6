"""``natsched audit --since ... --by-policy``: the live policy against its canary, from the records
JetStream kept, on a real nats-server.

Two ways in: records written with known numbers (every figure checked exactly, the verdicts
too), and a live canary split of a real stack (admitter, router, sim workers), where the audit's
per-policy counts and hit ratios must equal what the producers were told request by request.
"""

from __future__ import annotations

import time

import orjson

from natsched.wire.ids import scoped
import pytest

from natsched.audit.compare import percentile_se, ratio_se, share_se, verdict
from natsched.audit.records import AuditError, audit_by_policy
from natsched.client.producer import make_request
from natsched.router.core import in_canary
from natsched.stats import percentile
from natsched.wire import fence
from natsched.wire import msgids as M
from natsched.wire import subjects as S
from natsched.wire.schema import Completion, CompletionStatus, Decision
from tests.admitter.test_offline_runner import wait_for
from tests.client.test_batch_submit import cli

N = 40


async def _record(bus, rid: str, policy: str, ttft: float, cached: int, *, prompt: int = 100, wait: float = 0.0,
                  status: str = "ok", reason: str | None = None, worker: str = "w1", tenant: str = "t1",
                  attempt: int = 0, routed: str = "assign") -> None:
    now = time.time()
    await bus.jpublish(S.decision("admission", tenant), Decision(
        request_id=rid, tenant=tenant, stage="admission", decision="allow", ts=now, queue_wait=wait))
    await bus.jpublish(S.decision("routing", tenant), Decision(
        request_id=rid, tenant=tenant, stage="routing", decision=routed, ts=now, policy=policy,
        worker=worker if routed == "assign" else None, reason=reason if routed == "fail" else None),
        msg_id=f"{rid}:routing:{attempt}")
    if routed != "assign":
        return
    done = Completion(request_id=rid, tenant=tenant, status=CompletionStatus(status), runtime_tokens=108,
                      worker=worker, prompt_tokens=prompt, cached_tokens=cached, output_tokens=8, ttft=ttft,
                      tpot=0.01, e2e=ttft + 0.07, ts=time.time(), reason=reason if status != "ok" else None,
                      attempt=attempt, fence=fence.sign(bus.fence_key, rid, worker, attempt))
    await bus.jpublish(S.completion(tenant, worker), done, msg_id=M.completion(rid, done.fence))


async def test_two_policies_are_compared_with_exact_numbers(bus, nats_url):
    since = time.time() - 1
    await bus.kv(S.BUCKET_CONFIG).put(S.KEY_ROUTER_CONFIG, orjson.dumps(
        {"policy": "least_loaded", "canary": "natsched", "canary_share": 0.5}))
    base_ttft = [0.20 + 0.01 * i for i in range(N)]
    canary_ttft = [0.05 + 0.002 * i for i in range(N)]
    for i in range(N):
        await _record(bus, f"b{i}", "least_loaded", base_ttft[i], cached=10 + (i % 3), wait=0.1 * (i % 2))
        await _record(bus, f"c{i}", "natsched", canary_ttft[i], cached=60 + (i % 5), wait=0.1 * (i % 2))
    # a canary request that ran twice (its first worker died): only its last completion counts
    await _record(bus, "c0", "natsched", 9.0, cached=0, worker="w2", attempt=1)
    await _record(bus, "cx", "natsched", 0.0, cached=0, routed="fail", reason="no_worker")
    await _record(bus, "be", "least_loaded", 0.3, cached=0, status="error", reason="engine")
    # a completion nobody routed and a forged one are no part of any policy
    await bus.jpublish(S.completion("t1", "w1"), Completion(
        request_id="stray", tenant="t1", status=CompletionStatus.OK, runtime_tokens=1, worker="w1", ttft=5.0,
        ts=time.time(), fence=fence.sign(bus.fence_key, "stray", "w1", 0)), msg_id="stray")

    await bus.jpublish(S.decision("routing", "t1"), b"not a decision", msg_id="garbage")  # logged, left out
    report = await audit_by_policy(bus, since)
    assert report["baseline"] == "least_loaded"  # the routing config's live policy
    assert report["config"]["canary"] == "natsched" and report["config"]["revision"] >= 1
    base, canary = report["policies"]["least_loaded"], report["policies"]["natsched"]
    assert (base["requests"], base["completed"], base["errors"], base["routing_failed"]) == (N + 1, N, {"engine": 1}, {})
    assert (canary["requests"], canary["completed"], canary["routing_failed"]) == (N + 1, N, {"no_worker": 1})
    canary_ttft[0] = 9.0  # c0's second attempt
    assert base["ttft_p50_s"] == pytest.approx(percentile(base_ttft, 50))
    assert canary["ttft_p99_s"] == pytest.approx(percentile(canary_ttft, 99))
    assert canary["ttft_p50_s_se"] == pytest.approx(percentile_se(canary_ttft, 50))
    base_cached = [10 + (i % 3) for i in range(N)]
    assert base["hit_ratio"] == pytest.approx(sum(base_cached) / (100 * N))
    assert base["hit_ratio_se"] == pytest.approx(ratio_se(base_cached, [100] * N))
    assert base["failed_share"] == pytest.approx(1 / (N + 1))
    assert base["queue_wait_p99_s"] == pytest.approx(0.1)
    vs = report["vs_baseline"]["natsched"]
    assert vs["ttft_p50_s"]["diff"] == pytest.approx(percentile(canary_ttft, 50) - percentile(base_ttft, 50))
    assert vs["ttft_p50_s"]["verdict"] == "better" and vs["hit_ratio"]["verdict"] == "better"
    assert vs["queue_wait_p50_s"]["verdict"] == "level"  # the same waits on both sides
    assert vs["hit_ratio"]["se"] == pytest.approx(
        (ratio_se(base_cached, [100] * N) ** 2
         + ratio_se([0] + [60 + (i % 5) for i in range(1, N)], [100] * N) ** 2) ** 0.5)

    shown = cli(nats_url, "audit", "--since", "10m", "--by-policy")
    assert shown.returncode == 0, shown.stderr
    assert "least_loaded (baseline)" in shown.stdout and "natsched - least_loaded" in shown.stdout
    assert "live least_loaded, canary natsched on 50%" in shown.stdout
    ttft_row = next(line for line in shown.stdout.splitlines() if line.startswith("TTFT p50"))
    assert ttft_row.rstrip().endswith("better")
    flipped = orjson.loads(cli(nats_url, "audit", "--since", "10m", "--by-policy", "--baseline", "natsched",
                               "--json").stdout)
    assert flipped["baseline"] == "natsched"
    assert flipped["vs_baseline"]["least_loaded"]["ttft_p50_s"]["verdict"] == "worse"


async def test_one_tenant_only_and_an_empty_window(bus, nats_url):
    since = time.time() - 1
    await _record(bus, "a1", "least_loaded", 0.1, cached=0, tenant="t1")
    await _record(bus, "a2", "natsched", 0.1, cached=0, tenant="t2")
    report = await audit_by_policy(bus, since, tenant="t2")
    assert list(report["policies"]) == ["natsched"] and report["baseline"] == "natsched"  # no config: the busiest
    assert report["vs_baseline"] == {} and report["config"] is None
    asked = await audit_by_policy(bus, since, baseline="round_robin")  # routed nothing: said so
    assert asked["baseline"] in ("least_loaded", "natsched") and "round_robin routed nothing" in asked["note"]
    empty = await audit_by_policy(bus, time.time() + 60)
    assert empty["policies"] == {} and empty["baseline"] is None
    shown = cli(nats_url, "audit", "--since", "now", "--by-policy")
    assert shown.returncode == 0 and "no routing decision in the window" in shown.stdout


async def test_bad_requests_are_refused_clearly(bus, nats_url):
    with pytest.raises(AuditError, match="before --since"):
        await audit_by_policy(bus, time.time(), time.time() - 60)
    for args, msg in ((("audit", "r1", "--by-policy"), "compare a window"),
                      (("audit", "--by-policy"), "give a request id, or a window"),
                      (("audit", "--since", "1h", "--baseline", "natsched"), "--baseline needs --by-policy")):
        shown = cli(nats_url, *args)
        assert shown.returncode == 1 and msg in shown.stderr, (args, shown.stderr)
    await bus.kv(S.BUCKET_CONFIG).put(S.KEY_ROUTER_CONFIG, b"not json")
    await _record(bus, "z1", "least_loaded", 0.1, cached=0)
    assert (await audit_by_policy(bus, time.time() - 60))["config"] is None  # a broken config is not a crash


def test_standard_errors():
    assert percentile_se([1.0], 50) is None and ratio_se([1.0], [2.0]) is None and share_se(0, 0) is None
    xs = [float(i) for i in range(1, 101)]
    # the 95 % interval of the median of 1..100 runs from rank 40 to rank 60
    assert percentile_se(xs, 50) == pytest.approx((60 - 40) / (2 * 1.959964))
    assert share_se(1, 4) == pytest.approx((0.25 * 0.75 / 4) ** 0.5)
    assert ratio_se([1, 1, 1], [2, 2, 2]) == 0.0  # every request hit the same share
    assert verdict(-0.5, 0.1, higher_is_better=False) == "better"
    assert verdict(-0.1, 0.1, higher_is_better=False) == "level" and verdict(0.5, None, True) == "level"


async def test_a_live_canary_split_is_audited_as_the_producers_saw_it(stack, bus, nats_url):
    since = time.time() - 1
    await bus.kv(S.BUCKET_CONFIG).put(S.KEY_ROUTER_CONFIG, orjson.dumps(
        {"policy": "round_robin", "canary": "sglang_cache_aware", "canary_share": 0.5}))
    assert await wait_for(lambda: stack.router.core.canary is not None)
    systems = [f"System prompt number {k} for the canary audit. " * 10 for k in range(3)]
    results = {}
    for i in range(24):
        rid = f"can{i}"
        results[rid] = await stack.client.submit(make_request("t1", f"question {i}", system_prompt=systems[i % 3],
                                                              max_tokens=3, id=rid))
    report = await audit_by_policy(bus, since)
    # the router splits on the id the request ran under: in its tenant's scope (natsched.wire.ids.scoped)
    side = {rid: "sglang_cache_aware" if in_canary(scoped("t1", rid), 0.5) else "round_robin" for rid in results}
    assert report["baseline"] == "round_robin"
    for policy in ("round_robin", "sglang_cache_aware"):
        mine = [r for rid, r in results.items() if side[rid] == policy]
        row = report["policies"][policy]
        assert (row["requests"], row["completed"]) == (len(mine), len(mine))
        assert row["hit_ratio"] == pytest.approx(sum(r.cached_tokens for r in mine) / sum(r.prompt_tokens for r in mine))
        assert row["ttft_p50_s"] == pytest.approx(percentile([r.ttft for r in mine], 50))
    assert set(report["vs_baseline"]) == {"sglang_cache_aware"}
