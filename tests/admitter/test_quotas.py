"""Quotas (validation, KV layout, corrupted entries) and the shared Usage value."""

import orjson
import pytest
from hypothesis import given, strategies as st

from natsched.admitter.errors import QuotaError, UsageError
from natsched.admitter.quotas import Quotas, TenantQuota
from natsched.admitter.usage import Usage


def sample_quotas() -> Quotas:
    return Quotas(total=300_000, hard_cap=500_000,
                  tenants={"a": TenantQuota(0.5, 2.0, None), "b": TenantQuota(0.25, 1.0, 100_000)},
                  models={"llama": 200_000}, queue_limits={"online": 10, "batch": 20},
                  unknown_tenant="reject", default_tenant=TenantQuota(0.1, 0.5, 5000))


# ---------------------------------------------------------------------- validation

@pytest.mark.parametrize("change,message", [
    (dict(tenants={"a": TenantQuota(0.7), "b": TenantQuota(0.4)}), "floors sum to 1.100"),
    (dict(total=-1), "cluster total"),
    (dict(hard_cap=-5), "hard cap"),
    (dict(tenants={"a": TenantQuota(floor=-0.1)}), "floor must be a share"),
    (dict(tenants={"a": TenantQuota(weight=-1)}), "weight"),
    (dict(tenants={"a": TenantQuota(cap=-1)}), "cap must be an integer >= 0"),
    (dict(tenants={"a.b": TenantQuota()}), "not a valid subject token"),
    (dict(models={"m": -3}), "model 'm'"),
    (dict(queue_limits={"gold": 5}), "unknown class 'gold'"),
    (dict(queue_limits={"online": -1}), "queue limit"),
    (dict(unknown_tenant="maybe"), "unknown_tenant"),
    (dict(tenants={"a": TenantQuota(0.95)}, default_tenant=TenantQuota(floor=0.1)), "floors sum to 1.050"),
])
def test_validate_refuses_with_a_clear_message(change, message):
    with pytest.raises(QuotaError, match=message):
        Quotas(**change).validate()


def test_floors_may_sum_to_exactly_one_and_default_floor_counts_only_when_unknown_tenants_enter():
    Quotas(tenants={"a": TenantQuota(0.1), "b": TenantQuota(0.2), "c": TenantQuota(0.7)}).validate()
    Quotas(tenants={"a": TenantQuota(0.95)}, default_tenant=TenantQuota(floor=0.1), unknown_tenant="reject").validate()


def test_lookups():
    q = sample_quotas()
    assert q.tenant_quota("a").weight == 2.0
    assert q.tenant_quota("stranger") is None  # unknown tenants rejected
    q.unknown_tenant = "default"
    assert q.tenant_quota("stranger").cap == 5000
    assert (q.model_limit("llama"), q.model_limit("other")) == (200_000, None)
    assert (q.queue_limit("online"), q.queue_limit("offline")) == (10, 0)
    assert q.ceiling() == 300_000 and Quotas(total=900, hard_cap=500).ceiling() == 500


# ---------------------------------------------------------------------- KV

def test_kv_round_trip_and_key_layout():
    q = sample_quotas()
    kv = q.to_kv()
    assert set(kv) == {"cluster.total", "cluster.hard_cap", "tenant.a", "tenant.b", "model.llama",
                       "class.online.queue", "class.batch.queue", "default.tenant", "unknown_tenant"}
    assert orjson.loads(kv["tenant.b"]) == {"floor": 0.25, "weight": 1.0, "cap": 100_000}
    back, errors = Quotas.from_kv(kv)
    assert errors == [] and back == q
    assert back.to_kv() == kv  # deterministic bytes: a CLI can diff them


def test_empty_bucket_gives_defaults():
    q, errors = Quotas.from_kv({})
    assert errors == [] and q == Quotas()


@pytest.mark.parametrize("key,value", [
    ("cluster.total", b"lots"), ("cluster.total", b"-4"), ("tenant.b", b"{\"floor\": 2}"),
    ("tenant.b", b"[1, 2]"), ("tenant.b", b"{\"flor\": 0.1}"), ("model.llama", b"1.5"),
    ("class.online.queue", b"null"), ("unknown_tenant", b"\"sometimes\""), ("default.tenant", b"\xff"),
])
def test_corrupted_entry_keeps_the_previous_value(key, value):
    previous = sample_quotas()
    kv = previous.to_kv() | {key: value}
    q, errors = Quotas.from_kv(kv, previous)
    assert q == previous
    assert len(errors) == 1 and errors[0].startswith(key) and "previous value kept" in errors[0]


def test_corrupted_entry_without_previous_falls_back_to_the_default():
    q, errors = Quotas.from_kv({"cluster.total": b"{", "tenant.a": b"{\"floor\": 0.2}"})
    assert q.total == Quotas().total and q.tenants == {"a": TenantQuota(0.2)}
    assert len(errors) == 1 and "not JSON" in errors[0]


def test_floor_edit_over_one_hundred_percent_is_refused_and_old_floor_kept():
    previous = Quotas(tenants={"a": TenantQuota(0.5), "b": TenantQuota(0.3)})
    kv = previous.to_kv() | {"tenant.b": TenantQuota(0.6).to_json(), "tenant.c": TenantQuota(0.1, 3.0).to_json()}
    q, errors = Quotas.from_kv(kv, previous)
    assert q.tenants["a"].floor == 0.5 and q.tenants["b"].floor == 0.3  # b's edit refused
    assert q.tenants["c"].floor == 0.1 and q.tenants["c"].weight == 3.0  # c's fits once b's is undone
    assert any("tenant.b: floor edit refused" in e for e in errors)
    q.validate()


def test_unknown_keys_are_reported_and_foreign_ones_ignored():
    kv = Quotas().to_kv() | {"tenat.a": b"{}", "cluster.dynamic_total": b"123"}
    q, errors = Quotas.from_kv(kv)
    assert q == Quotas()
    assert errors == ["tenat.a: unknown quota key, ignored"]


def test_removed_tenant_entry_removes_the_tenant():
    previous = sample_quotas()
    kv = previous.to_kv()
    del kv["tenant.b"]
    q, _ = Quotas.from_kv(kv, previous)
    assert set(q.tenants) == {"a"}


# ---------------------------------------------------------------------- Usage

def test_usage_plus_minus_are_values_and_clamp():
    u0 = Usage()
    u1 = u0.plus("a", "m", 100, long=True).plus("b", "m", 50)
    assert u0 == Usage()  # unchanged
    assert (u1.used, u1.tenants, u1.models, u1.long) == (150, {"a": 100, "b": 50}, {"m": 150}, 100)
    u2 = u1.minus("a", "m", 100, long=True).minus("b", "m", 80)
    assert u2 == Usage()  # zero keys dropped, counts clamped at 0
    with pytest.raises(ValueError):
        u0.plus("a", "m", -1)


def test_usage_json_round_trip():
    u = Usage().plus("a", "m", 10, long=True).plus("b", "n", 5)
    assert Usage.from_json(u.to_json()) == u
    assert Usage.from_json(b'{"used": 3, "tenants": {"a": 3}, "models": {"m": 3}, "long": 0}') == Usage(3, {"a": 3},
                                                                                                     {"m": 3})


_FULL = '"used": 0, "tenants": {}, "models": {}, "long": 0'


@pytest.mark.parametrize("raw,message", [
    (b"nope", "not JSON"), (b"[]", "JSON object"), (b'{"used": -1, "tenants": {}, "models": {}, "long": 0}', "'used'"),
    (b'{"used": true, "tenants": {}, "models": {}, "long": 0}', "'used'"),
    (b'{"used": 0, "tenants": [1], "models": {}, "long": 0}', "'tenants'"),
    (b'{"used": 0, "tenants": {}, "models": {"m": "x"}, "long": 0}', "'models.m'"),
    (b'{"used": 0, "tenants": {}, "models": {}, "long": 1.5}', "'long'"),
    # what the server writes as a publish ack, had a reply-to named the key: never a usage of 0
    (b'{"stream": "REQUESTS", "seq": 7}', "missing used, tenants, models, long; unknown field"),
    (b'{"used": 3, "tenants": {"a": 3}, "models": {"m": 3}}', "missing long"),  # (older writers: rebuilt)
    (("{" + _FULL + ', "seq": 7}').encode(), "unknown field"),
])
def test_usage_from_anything_not_written_by_an_admitter_raises_usage_error(raw, message):
    with pytest.raises(UsageError, match=message):
        Usage.from_json(raw)


@given(st.lists(st.tuples(st.booleans(), st.sampled_from("abc"), st.integers(0, 1000), st.booleans()), max_size=40))
def test_usage_never_negative(ops):
    u = Usage()
    for add, tenant, tokens, long in ops:
        u = u.plus(tenant, "m", tokens, long) if add else u.minus(tenant, "m", tokens, long)
        assert u.used >= 0 and u.long >= 0 and all(v > 0 for v in u.tenants.values())
        assert Usage.from_json(u.to_json()) == u
