"""Router pools (natsched.wire.pools): the pool rule, its map, and the subjects it writes."""

import pytest

from natsched.wire import subjects as S
from natsched.wire.errors import IdError
from natsched.wire.ids import is_token
from natsched.wire.pools import ANY_MODEL, PoolError, PoolMap, check_pool, pool_name

HOSTILE = ["a.b", "x.>", "*", ">", "a b", "Qwen/Qwen2.5-0.5B", "../..", "t\n", "mödel", ".", "a.*.c", "all",
           "x" * 300, "tenant.online.evil"]


@pytest.mark.parametrize("model", HOSTILE)
def test_a_hostile_model_name_becomes_one_token_and_adds_no_subject_token(model):
    name = pool_name(model)
    assert is_token(name) and name != S.DEFAULT_POOL
    subject = S.admitted(name, S.ONLINE, "t")
    assert subject.split(".") == ["adm", name, "online", "t"]  # four tokens, no wildcard
    assert S.pool_admitted(name) == f"adm.{name}.>"
    check_pool(name)  # its consumer name fits too


def test_pool_names_of_distinct_models_stay_distinct():
    names = [pool_name(m) for m in HOSTILE + ["a_b", "a-b", "Qwen_Qwen2_5-0_5B"]]
    assert len(set(names)) == len(names)
    assert pool_name("llama") == "llama"  # a model that is a token already is its own name


@pytest.mark.parametrize("bad", ["a.b", "*", ">", "", "a b", "x" * 128])
def test_a_pool_that_is_not_one_token_is_refused_by_the_map_and_the_builders(bad):
    with pytest.raises(PoolError):
        PoolMap({bad: frozenset({"m"})})
    if not is_token(bad):
        with pytest.raises(IdError):
            S.admitted(bad, S.ONLINE, "t")


def test_no_map_is_one_pool_of_every_model():
    m = PoolMap()
    assert not m.configured and m.pool_of("anything") == S.DEFAULT_POOL
    assert m.routes(S.DEFAULT_POOL, ["whatever"])
    assert m.admitted_subject("m", S.BATCH, "t") == "adm.all.batch.t"
    assert PoolMap.parse("") == m == PoolMap.from_json(None) == PoolMap.from_json(b"{}")


def test_the_map_sends_each_model_to_its_pool_and_star_takes_the_rest():
    m = PoolMap.parse("a=ma, ma2 ;b=mb;Qwen/Qwen2.5")
    assert m.pool_of("ma") == m.pool_of("ma2") == "a" and m.pool_of("mb") == "b"
    assert m.pool_of("Qwen/Qwen2.5") == pool_name("Qwen/Qwen2.5")
    assert m.pool_of("other") is None  # no pool: the admitter refuses it (no_pool)
    assert m.routes("a", ["x", "ma2"]) and not m.routes("b", ["ma"]) and not m.routes(S.DEFAULT_POOL, ["ma"])
    star = PoolMap.parse(f"a=ma;b=mb,{ANY_MODEL}")
    assert star.pool_of("other") == "b" and star.pool_of("ma") == "a"
    assert star.routes("b", ["other"]) and not star.routes("a", ["other"])
    assert PoolMap.from_json(m.to_json()) == m
    assert "a (ma, ma2)" in m.describe()


@pytest.mark.parametrize("raw, says", [
    (b"not json", "not JSON"), (b"[1]", "JSON object"), (b'{"a": "m"}', "JSON object"),
    (b'{"a": [1]}', "non-empty string"), (b'{"a": [[1]]}', "string"), (b'{"a": []}', "names no model"),
    (b'{"a": ["m"], "b": ["m"]}', "two pools"), (b'{"all": ["m"]}', "default pool"),
    (b'{"a.b": ["m"]}', "subject token"),
])
def test_a_bad_map_is_refused_with_what_is_wrong(raw, says):
    with pytest.raises(PoolError, match=says):
        PoolMap.from_json(raw)


def test_the_default_pool_keeps_the_router_consumer():
    assert S.pool_router(S.DEFAULT_POOL) == S.CONSUMER_ROUTER == "router"
    assert S.pool_router("a") == "router-a"
    # ADMITTED is a work queue: its consumers' filters must not overlap
    assert S.pool_admitted(S.DEFAULT_POOL) == "adm.all.>" != S.pool_admitted("a")
