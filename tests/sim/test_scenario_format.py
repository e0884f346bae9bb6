"""Scenario files: the built-in ones load, and every kind of mistake is refused naming its field."""

from __future__ import annotations

import copy
import json

import pytest

from natsched.sim.errors import ScenarioError, SimConfigError
from natsched.sim.scenario import BUILTIN_DIR, find_scenarios, load_scenario, parse_scenario

GOOD = {
    "name": "mine",
    "cluster": {"workers": [{"count": 2, "profile": "h100-llama8b"}]},
    "traffic": {"generator": "sessions", "duration_s": 60, "rate_rps": 1.0,
                "tenants": [{"name": "a", "share": 0.7, "floor": 0.5}, {"name": "b", "share": 0.3}]},
    "slo": {"ttft_s": {"online": 2.0}},
    "headline": {"metric": "online_goodput"},
}


def bad(path: str, value, delete: bool = False) -> dict:
    """GOOD with the dotted ``path`` set to ``value`` (or deleted)."""
    d = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    cur = d
    for p in parents:
        cur = cur[int(p)] if p.isdigit() else cur[p]
    if delete:
        del cur[last]
    elif last.isdigit():
        cur[int(last)] = value
    else:
        cur[last] = value
    return d


def test_builtin_scenarios_load():
    names = {load_scenario(p).name for p in find_scenarios(None)}
    assert names == {"steady", "chat-rag", "burst", "hetero", "elastic"}
    assert all(p.parent == BUILTIN_DIR for p in find_scenarios(None))


def test_a_good_dict_parses_with_its_defaults():
    sc = parse_scenario(copy.deepcopy(GOOD), "x")
    assert sc.n_workers == 2 and sc.headline == "online_goodput" and sc.higher_is_better
    assert [t.share for t in sc.traffic.tenants] == pytest.approx([0.7, 0.3])
    assert sc.traffic.classes == {"online": 1.0} and sc.sweep_points == 3


@pytest.mark.parametrize("path,value,field,words", [
    ("name", "Bad Name", "name", "lower-case"),
    ("cluster.workers", [], "cluster.workers", "must not be empty"),
    ("cluster.workers.0.profile", "h200", "cluster.workers[0].profile", "unknown profile"),
    ("cluster.workers.0.count", 0, "cluster.workers[0].count", ">= 1"),
    ("cluster.workers.0.count", 1.5, "cluster.workers[0].count", "integer"),
    ("cluster.workers.0.colour", "red", "cluster.workers[0].colour", "unknown key"),
    ("traffic.generator", "poisson", "traffic.generator", "unknown generator"),
    ("traffic.rate_rps", -1, "traffic.rate_rps", "> 0"),
    ("traffic.rate_rps", "fast", "traffic.rate_rps", "a number"),
    ("traffic.tenants.0.floor", 1.5, "traffic.tenants[0].floor", "<= 1"),
    ("traffic.tenants.1.name", "a", "traffic.tenants", "unique"),
    ("traffic.classes", {"realtime": 1}, "traffic.classes.realtime", "unknown class"),
    ("traffic.models", {"llama-70b": 1}, "traffic.models.llama-70b", "no worker serves"),
    ("traffic.turns", [3, 1], "traffic.turns", "low <= high"),
    ("traffic.bursts", [{"at_s": 10, "factor": 2}], "traffic.bursts[0].duration_s", "required"),
    ("slo.ttft_s", {"online": 0}, "slo.ttft_s.online", "> 0"),
    ("headline.metric", "goodness", "headline.metric", "unknown metric"),
    ("contenders", ["dynamo"], "contenders", "must include natsched"),
    ("contenders", ["natsched", "nginx"], "contenders[1]", "unknown contender"),
    ("extra", 1, "extra", "unknown key"),
])
def test_each_mistake_names_its_field(path, value, field, words):
    with pytest.raises(ScenarioError) as e:
        parse_scenario(bad(path, value), "f.yaml")
    assert e.value.field == field, str(e.value)
    assert words in str(e.value) and str(e.value).startswith("f.yaml: ")
    assert isinstance(e.value, SimConfigError)  # a ValueError, like every bad setting


@pytest.mark.parametrize("path,field", [("name", "name"), ("cluster", "cluster"), ("headline", "headline"),
                                        ("headline.metric", "headline.metric")])
def test_missing_required_fields(path, field):
    with pytest.raises(ScenarioError) as e:
        parse_scenario(bad(path, None, delete=True), "f")
    assert e.value.field == field and "required" in str(e.value)


def test_cross_field_rules():
    with pytest.raises(ScenarioError, match="needs slo.ttft_s.online"):
        parse_scenario(bad("slo", {}), "f")
    with pytest.raises(ScenarioError, match="is for traces"):
        parse_scenario(bad("traffic.target_busy", 0.7), "f")
    with pytest.raises(ScenarioError, match="either rate_rps"):
        parse_scenario(bad("traffic.load", 0.7), "f")
    d = bad("traffic.load", 0.7)
    del d["traffic"]["rate_rps"]
    assert parse_scenario(d, "f").traffic.load == 0.7
    d = bad("traffic.trace", "mooncake")
    with pytest.raises(ScenarioError, match="not both"):
        parse_scenario(d, "f")
    d = bad("events", [{"at_s": 10, "kind": "kill", "worker": "w9"}])
    with pytest.raises(ScenarioError) as e:
        parse_scenario(d, "f")
    assert e.value.field == "events[0].worker"
    d = bad("events", [{"at_s": 10, "kind": "slow", "worker": "w1", "factor": 3}])
    with pytest.raises(ScenarioError) as e:
        parse_scenario(d, "f")
    assert e.value.field == "events[0].factor"
    d = bad("headline", {"metric": "phase_ttft_p99_s"})
    with pytest.raises(ScenarioError, match="phase boundaries"):
        parse_scenario(d, "f")


def test_custom_profiles_are_checked():
    d = bad("cluster.profiles", {"slow": {"base": "h100-llama8b", "peak_flops": 1e14}})
    d["cluster"]["workers"][0]["profile"] = "slow"
    sc = parse_scenario(d, "f")
    assert sc.profile("slow").peak_flops == 1e14 and sc.profile("slow").bandwidth == sc.profile("h100-llama8b").bandwidth
    d["cluster"]["profiles"]["slow"]["flux"] = 3
    with pytest.raises(ScenarioError) as e:
        parse_scenario(d, "f")
    assert e.value.field == "cluster.profiles.slow.flux"
    d = bad("cluster.profiles", {"slow": {"base": "tpu"}})
    with pytest.raises(ScenarioError) as e:
        parse_scenario(d, "f")
    assert e.value.field == "cluster.profiles.slow.base"


def test_files_yaml_json_and_broken(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(GOOD))
    assert load_scenario(tmp_path / "a.json").name == "mine"
    (tmp_path / "b.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match="not YAML at line"):
        load_scenario(tmp_path / "b.yaml")
    (tmp_path / "c.json").write_text("{")
    with pytest.raises(ScenarioError, match="not JSON"):
        load_scenario(tmp_path / "c.json")
    (tmp_path / "d.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ScenarioError, match="must be a mapping"):
        load_scenario(tmp_path / "d.yaml")
    with pytest.raises(ScenarioError, match="no such file"):
        find_scenarios([tmp_path / "nope.yaml"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ScenarioError, match="holds no"):
        find_scenarios([empty])
    assert [p.name for p in find_scenarios([tmp_path])] == ["a.json", "b.yaml", "c.json", "d.yaml"]


def test_the_generalisation_files_load_and_name_workers_that_exist():
    """natsched/sim/scenarios/variants: other clusters and traffic, never used to tune anything."""
    from natsched.sim.scenario import BUILTIN_DIR, find_scenarios, load_scenario

    paths = find_scenarios([BUILTIN_DIR / "variants"])
    assert len(paths) >= 6
    for p in paths:
        sc = load_scenario(p)
        n = sc.n_workers + sum(e.count for e in sc.events if e.kind == "add")
        ids = {f"w{i:0{len(str(n - 1))}d}" for i in range(sc.n_workers)}
        assert all(e.worker in ids for e in sc.events if e.kind in ("kill", "slow")), p.name


def _events(*events) -> dict:
    return bad("events", list(events))


@pytest.mark.parametrize("events,index,message", [
    ([{"at_s": 10, "kind": "kill", "worker": "w2"}], 0, "no worker 'w2': the cluster has 2 and events add 0"),
    # an added worker exists only from its add on (the simulator runs events by time)
    ([{"at_s": 10, "kind": "kill", "worker": "w2"}, {"at_s": 20, "kind": "add"}], 0, "not added yet"),
    ([{"at_s": 5, "kind": "kill", "worker": "w1"},
      {"at_s": 9, "kind": "slow", "worker": "w01", "factor": 0.5}], 1, "killed by an earlier event"),
    # file order is not time order: the later kill in the file runs first
    ([{"at_s": 30, "kind": "kill", "worker": "w0"}, {"at_s": 10, "kind": "kill", "worker": "w0"}], 0,
     "killed by an earlier event"),
])
def test_event_workers_are_checked_against_the_cluster_in_time_order(events, index, message):
    with pytest.raises(ScenarioError) as e:
        parse_scenario(_events(*events), "mine.yaml")
    assert e.value.field == f"events[{index}].worker" and message in e.value.detail
    assert str(e.value).startswith(f"mine.yaml: events[{index}].worker: ")


def test_event_workers_take_the_simulators_spelling():
    """11 workers after the add: the simulator names them w00..w10; ``w1`` and ``w01`` are one."""
    d = _events({"at_s": 1, "kind": "add", "count": 9}, {"at_s": 2, "kind": "slow", "worker": "w1", "factor": 0.5},
                {"at_s": 3, "kind": "kill", "worker": "w9"}, {"at_s": 4, "kind": "kill", "worker": "w01"})
    sc = parse_scenario(d, "f")
    assert [e.worker for e in sc.events] == [None, "w01", "w09", "w01"]


def test_a_wrong_worker_id_fails_when_the_file_is_read(tmp_path):
    """Before: this file loaded, and the run failed at the event (minutes in, for a real scenario)."""
    d = _events({"at_s": 1, "kind": "add", "count": 2}, {"at_s": 2, "kind": "kill", "worker": "w4"})
    (tmp_path / "typo.json").write_text(json.dumps(d))
    with pytest.raises(ScenarioError, match=r"typo.json: events\[1\].worker: no worker 'w4'.*ids w0..w3"):
        load_scenario(tmp_path / "typo.json")


def test_a_slowdown_ending_after_its_worker_died_is_no_error():
    """slow w0 for 60 s, killed at 20 s: the end of the slowdown has nothing to restore."""
    from natsched.sim.bench_scenarios import sim_settings
    from natsched.sim.des import Simulator
    from natsched.sim.traffic import generate

    d = _events({"at_s": 1, "kind": "slow", "worker": "w0", "factor": 0.5, "duration_s": 60},
                {"at_s": 20, "kind": "kill", "worker": "w0"})
    d["traffic"]["duration_s"] = 90
    sc = parse_scenario(d, "f")
    sim = Simulator(generate(sc), sim_settings(sc, "least_loaded", rescue=False))
    sim.run()
    assert not sim.workers["w0"].alive and sim.workers["w1"].alive
