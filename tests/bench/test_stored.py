"""natsched bench stored against the real services: every stream's writes per request are counted
from the server's own sequence numbers, and inline routing stores one decision message per request."""

from __future__ import annotations

import orjson

from natsched.bench.stored import kind_of, stored_per_stream
from natsched.cli.app import main


def test_wire_kinds_name_streams_kv_keys_acks_and_decision_stages():
    assert kind_of("$KV.inflight.res.r1", b"", {}) == "kv inflight.res put"
    assert kind_of("$KV.inflight.res.r1", b"", {"KV-Operation": "PURGE"}) == "kv inflight.res purge"
    assert kind_of("$JS.ACK.WORK.worker-w1.1.2.3.4.0", b"+WPI", {}) == "ack WORK +WPI"
    assert kind_of("$JS.API.CONSUMER.MSG.NEXT.REQUESTS.admitter", b"{}", {}) == "api pull"
    assert kind_of("decision.routing.t1", b"", {}) == "decision.routing"
    assert kind_of("req.online.t1", b"", {}) == "req"


def test_writes_are_sequence_growth_and_unchanged_streams_are_left_out():
    before = {"WORK": {"messages": 0, "bytes": 0, "last_seq": 10}, "REQUESTS": {"messages": 5, "bytes": 50, "last_seq": 5}}
    after = {"WORK": {"messages": 0, "bytes": 0, "last_seq": 30}, "REQUESTS": {"messages": 5, "bytes": 50, "last_seq": 5},
             "DECISIONS": {"messages": 20, "bytes": 2000, "last_seq": 20}}
    assert stored_per_stream(before, after, 20) == {
        "DECISIONS": {"writes": 1.0, "kept_bytes": 100.0, "kept": 1.0},
        "WORK": {"writes": 1.0, "kept_bytes": 0.0, "kept": 0.0}}


def test_a_short_run_counts_one_write_per_hop_and_one_decision_message_inline(tmp_path, capsys):
    two, inline = tmp_path / "two.json", tmp_path / "inline.json"
    assert main(["bench", "stored", "--requests", "40", "--rate", "40", "--json", str(two)]) == 0
    assert main(["bench", "stored", "--requests", "40", "--rate", "40", "--inline-routing", "--json", str(inline)]) == 0
    assert "writes/req" in capsys.readouterr().out
    a, b = orjson.loads(two.read_bytes()), orjson.loads(inline.read_bytes())
    assert a["completed"] == b["completed"] == 40 and a["lost"] == b["lost"] == 0
    for stream in ("REQUESTS", "ADMITTED", "WORK", "COMPLETIONS"):
        assert a["streams"][stream]["writes"] == 1.0, stream
    assert a["streams"]["DECISIONS"]["writes"] == 2.0  # admission and routing, two processes
    assert b["streams"]["DECISIONS"]["writes"] == 1.0 and "ADMITTED" not in b["streams"]
    assert a["streams"]["KV_inflight"]["writes"] >= 2.0  # a reservation record and its release marker
    assert a["on_wire"]["req (delivered)"] == 1.0 and a["on_wire"]["ack WORK +ACK"] == 1.0
