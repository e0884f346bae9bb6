"""Config without code (issue 25): admission settings set live through the quotas bucket and at
start by flags, refused with a clear error that changes nothing; routing and quota rollbacks
from the buckets' history. Real nats-server, a real admitter, the CLI as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import typing

import orjson
import pytest

from natsched.admitter import knobs as K
from natsched.admitter.errors import SettingsError
from natsched.ops.rollback import RollbackError, quota_plan, quota_target, route_target
from natsched.wire import subjects as S
from tests.factories.core import wait_for

PY = [sys.executable, "-m", "natsched"]


def cli(url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([*PY, *args], env=os.environ | {"NATSCHED_NATS_URL": url}, capture_output=True, text=True,
                         timeout=60)
    if check:
        assert out.returncode == 0, out.stderr
    return out


async def _entries(bus) -> dict[str, bytes]:
    kv = bus.kv(S.BUCKET_QUOTAS)
    out = {}
    for key in await kv.keys():
        got = await kv.get(key)
        if got is not None:
            out[key] = got[0]
    return out


# --- the pure parts ------------------------------------------------------------------------

def test_every_settings_field_is_a_knob_and_bad_values_are_refused():
    assert {"admission.long_threshold_tokens", "admission.reserve_long_share", "admission.aging_s",
            "admission.degrade_watermark", "admission.queue_timeout_s", "admission.calibrated_output",
            "dynamic.interval_s", "dynamic.high", "dynamic.low", "lease.missed", "scale.out_wait_s"} <= set(K.names())
    for bad in ({"admission.aging_s": -1}, {"admission.reserve_long_share": 1.0}, {"admission.nope": 1},
                {"admission.calibrated_output": "yes"}, {"dynamic.low": 0.95}, {"dynamic.interval_s": 0},
                {"lease.missed": 0}, {"scale.idle_util": 1.5}, {"admission.scan_limit": 2.5},
                {"admission.degrade_classes": ["gold"]}, {"admission.queue_timeout_s": float("inf")}):
        with pytest.raises(SettingsError):
            K.apply(K.Knobs(), bad)


def test_every_listed_knob_can_be_set_the_per_class_slo_included():
    # a knob that names() lists but no value can set is a flag in name only
    values = {bool: True, int: 7, float: 0.5, tuple: ["batch"], dict: {"online": 2}}
    for key in K.names():
        kind = K._field_type(*K.split(key))
        value = values[typing.get_origin(kind) or kind]
        try:
            K.apply(K.Knobs(), {key: value})
        except SettingsError as exc:
            assert "cannot be set" not in str(exc), key  # a range check is fine; unsettable is not
    key, value = K.parse_assignment('admission.slo_ttft_s={"online": 2, "batch": 30}')
    knobs = K.apply(K.Knobs(), {key: value})
    assert knobs.admission.slo_ttft_s == {"online": 2.0, "batch": 30.0}
    assert K.flat(knobs)["admission.slo_ttft_s"] == {"online": 2.0, "batch": 30.0}
    for bad, says in (({"online": 0}, "must be seconds > 0"), ({"gold": 1}, "unknown classes ['gold']"),
                      ([2], "JSON object"), ({"online": "2"}, "finite number"), ({"online": float("nan")}, "finite")):
        with pytest.raises(SettingsError, match=re.escape(says)):
            K.apply(K.Knobs(), {"admission.slo_ttft_s": bad})


def test_resolve_skips_a_bad_entry_and_keeps_the_good_ones():
    entries = {"setting.admission.aging_s": b"5", "setting.dynamic.high": b"0.1", "setting.x.y": b"1",
               "setting.admission.queue_timeout_s": b"not json"}
    knobs, errors = K.resolve(K.Knobs(), entries)
    assert knobs.admission.aging_s == 5.0 and knobs.dynamic.high == K.Knobs().dynamic.high
    assert len(errors) == 3
    running = K.apply(K.Knobs(), {"admission.queue_timeout_s": 12, "dynamic.high": 0.9})
    knobs, _ = K.resolve(K.Knobs(), entries, previous=running)  # the bad ones keep what ran
    assert knobs.admission.queue_timeout_s == 12.0 and knobs.dynamic.high == 0.9 and knobs.admission.aging_s == 5.0


def test_route_and_quota_targets_from_history_rows():
    cfg = lambda p: orjson.dumps({"policy": p})
    rows = [("router", cfg("a"), 1, "PUT"), ("router", cfg("b"), 4, "PUT")]
    assert route_target(rows, None) == (1, cfg("a"))
    assert route_target(rows, 4) == (4, cfg("b"))
    with pytest.raises(RollbackError, match="revisions kept: 1, 4"):
        route_target(rows, 2)
    with pytest.raises(RollbackError):
        route_target(rows[:1], None)
    q = [("cluster.total", b"1", 1, "PUT"), ("change", b"{}", 2, "PUT"), ("cluster.total", b"2", 3, "PUT"),
         ("tenant.a", b"{}", 4, "PUT"), ("change", b"{}", 5, "PUT"), ("cluster.dynamic_total", b"9", 6, "PUT")]
    assert quota_target(q, None) == 2
    plan = quota_plan(q, 2, history=10)
    assert plan.put == {"cluster.total": b"1"} and plan.delete == ["tenant.a"]
    with pytest.raises(RollbackError, match="older than the history kept"):
        quota_plan(q, 0, history=2)  # cluster.total's two slots are both after revision 0


# --- against a real admitter -----------------------------------------------------------------

async def test_a_setting_set_live_reaches_the_admitter_and_a_bad_one_changes_nothing(bus, nats_url):
    from tests.admitter.test_service import start_admitter, stop

    adm = await start_admitter(nats_url)
    try:
        assert adm.core.settings.aging_s == 10.0 and not adm.core.settings.calibrated_output
        out = cli(nats_url, "quota", "set", "--set", "admission.aging_s=2.5", "--set",
                  "admission.calibrated_output=true", "--set", "lease.missed=5", "--set", "dynamic.high=0.9",
                  "--set", 'admission.slo_ttft_s={"online": 2}')
        assert "setting admission.aging_s: unset -> 2.5" in out.stdout
        assert await wait_for(lambda: adm.core.settings.aging_s == 2.5)
        assert adm.core.settings.calibrated_output and adm.leases.missed == 5 and adm.dynamic.settings.high == 0.9
        assert adm.core.settings.slo_ttft_s == {"online": 2.0}
        # the total while the bucket names none: a knob the quotas read once ignored (always 400000)
        assert "cluster.total" not in await _entries(bus)
        cli(nats_url, "quota", "set", "--set", "admission.default_total=5555")
        assert await wait_for(lambda: adm.total == 5555)
        assert orjson.loads(cli(nats_url, "quota", "show", "--json").stdout)["total"] == 5555  # what runs
        assert "cluster.total" not in await _entries(bus)  # shown, not pinned
        cli(nats_url, "quota", "set", "--unset", "admission.default_total")
        assert await wait_for(lambda: adm.total == 400_000)
        before = await _entries(bus)
        for bad, says in ((["--set", "admission.aging_s=-1"], "aging_s must be >= 0"),
                          (["--set", "admission.nope=1"], "unknown setting 'admission.nope'; known: "),
                          (["--set", "dynamic.low=0.95"], "0 < low < high"),
                          (["--set", "admission.calibrated_output=maybe"], "must be true or false"),
                          (["--set", "admission.aging_s"], "KEY=VALUE"),
                          (["--unset", "admission.queue_timeout_s"], "not set live"),
                          (["--total", "500", "--set", "lease.missed=0"], "lease missed must be an integer >= 1")):
            refused = cli(nats_url, "quota", "set", *bad, check=False)
            assert refused.returncode == 1 and "nothing written" in refused.stderr and says in refused.stderr, \
                (bad, refused.stderr)
        assert await _entries(bus) == before  # not even the valid --total of the last one
        shown = orjson.loads(cli(nats_url, "quota", "show", "--json").stdout)
        assert shown["settings"]["admission.aging_s"] == 2.5
        # a bad value written around the CLI: logged and counted, the last good one kept
        await bus.kv(S.BUCKET_QUOTAS).put("setting.admission.aging_s", b"-3")
        assert await wait_for(lambda: adm.metrics.bad_quota_entries._value.get() >= 1)
        assert adm.core.settings.aging_s == 2.5
        cli(nats_url, "quota", "set", "--unset", "admission.aging_s")
        assert await wait_for(lambda: adm.core.settings.aging_s == 10.0)  # back to the start value
    finally:
        await stop(adm)


def test_start_flags_are_checked_before_anything_starts(nats_url):
    for cmd in (["admitter", "--set", "admission.aging_s=-1"], ["up", "--set", "scale.window_s=0", "--port", "1"]):
        out = cli(nats_url, *cmd, check=False)
        assert out.returncode == 1 and "--set refused" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_route_rollback_restores_the_previous_config_and_a_named_revision(bus, nats_url):  # bus: a clean JetStream
    cli(nats_url, "route", "set", "--policy", "least_loaded")
    cli(nats_url, "route", "set", "--policy", "natsched", "--canary", "least_loaded", "--canary-share", "0.2")
    history = cli(nats_url, "route", "history").stdout.splitlines()
    assert len(history) == 2 and "canary least_loaded on 20%" in history[1]
    out = cli(nats_url, "route", "rollback").stdout
    assert "rolled back to revision" in out and "policy least_loaded; no canary" in out
    assert orjson.loads(cli(nats_url, "route", "show", "--json").stdout)["policy"] == "least_loaded"
    canary_rev = history[1].split()[0]
    cli(nats_url, "route", "rollback", "--to", canary_rev)
    assert orjson.loads(cli(nats_url, "route", "show", "--json").stdout)["canary"] == "least_loaded"
    refused = cli(nats_url, "route", "rollback", "--to", "999999", check=False)
    assert refused.returncode == 1 and "not a routing config in the history" in refused.stderr


def test_quota_rollback_undoes_one_edit_of_several_keys(bus, nats_url):
    cli(nats_url, "quota", "set", "--total", "5000")
    cli(nats_url, "quota", "set", "--total", "7000", "--tenant", "acme", "--floor", "0.3",
        "--set", "admission.aging_s=4")
    out = cli(nats_url, "quota", "rollback").stdout
    assert "total: 7000 -> 5000" in out and "setting admission.aging_s: 4 -> unset" in out
    shown = orjson.loads(cli(nats_url, "quota", "show", "--json").stdout)
    assert shown["total"] == 5000 and "acme" not in shown["tenants"] and shown["settings"] == {}
    history = cli(nats_url, "quota", "history").stdout
    assert "rollback to revision" in history and "total: 5000 -> 7000" in history
    first = history.splitlines()[0].split()[0]  # after the first edit: total 5000 (again)
    cli(nats_url, "quota", "rollback", "--to", first)
    assert orjson.loads(cli(nats_url, "quota", "show", "--json").stdout)["total"] == 5000
    refused = cli(nats_url, "quota", "rollback", "--to", "99999999", check=False)
    assert refused.returncode == 1 and "outside the bucket's history" in refused.stderr
