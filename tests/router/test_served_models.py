"""Models and LoRA adapters: the router considers only workers that serve a request's model or
adapter, prefers one with the adapter loaded, and the gateway's model list shows vLLM's fields."""

from __future__ import annotations

from natsched.gateway.protocol import models_body
from natsched.gateway.status import StatusState
from natsched.router.core import RouterCore, RouterSettings
from natsched.wire.schema import Heartbeat, ServedModel
from tests.factories.router import make_hb, make_req

NOW = 100.0


def card(id, parent=None, active=False, max_model_len=4096):
    return ServedModel(id=id, created=1700000000, root=f"/models/{id}", parent=parent,
                       max_model_len=max_model_len, active=active)


def core_with(served: dict[str, list[ServedModel]], model: str = "llama") -> RouterCore:
    core = RouterCore(RouterSettings(policy="natsched"))
    for w, cards in served.items():
        core.on_heartbeat(make_hb(w, model=model, served=cards), 0.0)
        core.on_heartbeat(make_hb(w, seq=2, model=model, served=cards), NOW)
    return core


def test_only_workers_serving_the_adapter_are_candidates():
    core = core_with({"w0": [card("llama"), card("sql", "llama")], "w1": [card("llama")]})
    assert [w.id for w in core.candidates(make_req("r1", model="sql"), NOW)] == ["w0"]
    assert {w.id for w in core.candidates(make_req("r2", model="llama"), NOW)} == {"w0", "w1"}
    assert core.candidates(make_req("r3", model="nobody-serves-this"), NOW) == []
    assert core.route(make_req("r4", model="sql"), NOW).worker == "w0"


def test_a_worker_with_the_adapter_loaded_is_preferred():
    core = core_with({"w0": [card("llama"), card("sql", "llama")],
                      "w1": [card("llama"), card("sql", "llama", active=True)],
                      "w2": [card("llama"), card("sql", "llama")]})
    for i in range(5):
        assert core.route(make_req(f"r{i}", model="sql", tag=f"p{i}"), NOW).worker == "w1"


def test_a_loaded_adapter_on_a_full_worker_does_not_pin_its_traffic():
    core = core_with({"w0": [card("llama"), card("sql", "llama")],
                      "w1": [card("llama"), card("sql", "llama", active=True)]})
    core.on_heartbeat(make_hb("w1", seq=3, model="llama", runtime_tokens=400_000,
                              served=[card("llama"), card("sql", "llama", active=True)]), NOW)
    assert {w.id for w in core.candidates(make_req("r1", model="sql"), NOW)} == {"w0", "w1"}


def test_an_adapter_unloaded_from_a_worker_is_no_longer_served_there():
    core = core_with({"w0": [card("llama"), card("sql", "llama")]})
    core.on_heartbeat(make_hb("w0", seq=3, model="llama", served=[card("llama")]), NOW)
    assert core.candidates(make_req("r1", model="sql"), NOW) == []


def test_no_worker_names_the_unserved_model_and_the_served_ones():
    core = core_with({"w0": [card("llama"), card("sql", "llama")], "w1": [card("llama")]})
    why = core.registry.why_no_worker("ada", NOW)
    assert "'ada'" in why and "served: llama, sql" in why and "no worker serves" in why
    core.on_heartbeat(make_hb("w0", seq=3, model="llama", state="quiescing",
                              served=[card("llama"), card("sql", "llama")]), NOW)
    assert core.route(make_req("r1", model="sql"), NOW).worker is None
    assert core.registry.why_no_worker("sql", NOW) == "no worker serving model 'sql' can take it now (w0 quiescing)"
    assert "w0 stale" in core.registry.why_no_worker("sql", NOW + 60)  # silent: says so


def test_the_model_list_has_vllms_fields_for_every_served_model_and_adapter():
    state = StatusState()
    state.on_heartbeat(Heartbeat(worker="w0", seq=1, ts=NOW, model="llama",
                                 served=[card("llama"), card("sql", "llama", max_model_len=None)]), NOW)
    state.on_heartbeat(Heartbeat(worker="w1", seq=1, ts=NOW, model="sim-model"), NOW)
    body = models_body(state.models(NOW), created=5, cards=state.model_cards())
    by_id = {m["id"]: m for m in body["data"]}
    assert set(by_id) == {"llama", "sql", "sim-model"}
    assert by_id["sql"] == {"id": "sql", "object": "model", "created": 1700000000, "owned_by": "vllm",
                            "root": "/models/sql", "parent": "llama", "max_model_len": None, "ready": True}
    assert by_id["llama"]["max_model_len"] == 4096 and by_id["llama"]["parent"] is None
    assert by_id["sim-model"] == {"id": "sim-model", "object": "model", "created": 5, "owned_by": "natsched",
                                  "root": "sim-model", "parent": None, "max_model_len": None, "ready": True}


def test_served_models_survive_the_wire():
    hb = Heartbeat(worker="w0", seq=1, ts=1.0, served=[card("sql", "llama", active=True)])
    back = Heartbeat.decode(hb.encode())
    assert back.served == hb.served and back.served[0].active is True
