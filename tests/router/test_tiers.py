"""Tier-aware cache credit: the index keeps host-tier blocks apart, the cost model prices them by transfer."""

from __future__ import annotations

import pytest

from natsched.router.costmodel import CostModel
from natsched.router.core import RouterCore, RouterSettings
from natsched.wire.errors import SchemaError
from natsched.wire.schema import CacheEvent
from tests.factories.router import chain, make_hb, make_req

PREFIX = chain(40, "sys")


def ev(worker: str, seq: int, kind: str, hashes=(), tier: str | None = None) -> CacheEvent:
    return CacheEvent(worker=worker, seq=seq, kind=kind, ts=float(seq), hashes=list(hashes), tier=tier)


def core_with(*workers: str) -> RouterCore:
    core = RouterCore(RouterSettings(policy="natsched", heartbeat_timeout_s=600.0))
    for w in workers:
        core.on_heartbeat(make_hb(w, seq=1, interval=600.0), 0.0)
    return core


def test_the_index_keeps_host_blocks_apart_and_continues_a_gpu_match_with_them():
    core = core_with("w0")
    idx = core.index
    assert core.on_cache_event(ev("w0", 1, "stored", PREFIX[:10]), 1.0)
    assert core.on_cache_event(ev("w0", 2, "stored", PREFIX[10:30], "host"), 1.0)
    assert idx.match_one(PREFIX, "w0", 1.0) == 10  # the GPU tier alone
    assert idx.match_host(PREFIX, "w0", 10) == 20  # then the host tier
    assert core.on_cache_event(ev("w0", 3, "removed", PREFIX[20:30], "host"), 1.0)
    assert idx.match_host(PREFIX, "w0", 10) == 10
    assert core.on_cache_event(ev("w0", 4, "snapshot", PREFIX[10:15], "host"), 1.0)  # replaces the host tier only
    assert idx.match_host(PREFIX, "w0", 10) == 5 and idx.match_one(PREFIX, "w0", 1.0) == 10
    assert core.on_cache_event(ev("w0", 5, "snapshot", PREFIX[:3]), 1.0)  # a GPU snapshot resets both
    assert idx.match_host(PREFIX, "w0", 3) == 0
    assert core.on_cache_event(ev("w0", 7, "stored", PREFIX[3:9], "host"), 1.0) is False  # a gap: distrusted
    assert idx.match_host(PREFIX, "w0", 3) == 0


def test_a_host_hit_is_priced_by_its_transfer_time():
    cost = CostModel()
    full = cost.first_token_s(8192)
    loaded = cost.first_token_s(1024, 7168, host_tokens=7168)
    gpu = cost.first_token_s(1024, 7168)
    assert gpu < loaded < full  # dearer than a GPU hit, cheaper than recomputing
    assert loaded - gpu == pytest.approx(7168 / cost.host_tokens_per_s)


def test_natsched_prefers_a_host_hit_over_a_recompute_and_says_so():
    core = core_with("w0", "w1")
    core.on_cache_event(ev("w1", 1, "stored", PREFIX, "host"), 1.0)  # w1 offloaded the whole prefix
    d = core.route(make_req("a", hashes=PREFIX), 1.0)
    assert d.worker == "w1"
    assert d.terms["w1"]["host_tokens"] == 40 * 32 and d.terms["w0"]["host_tokens"] == 0
    assert d.expected_cached_tokens == 40 * 32
    assert core.assignment("a").host_tokens == 40 * 32


def test_an_unknown_tier_is_a_schema_error():
    with pytest.raises(SchemaError, match="tier"):
        CacheEvent.from_wire({"worker": "w0", "seq": 1, "kind": "stored", "ts": 0.0, "tier": "disk"})
