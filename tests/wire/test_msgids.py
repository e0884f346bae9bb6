"""Nats-Msg-Id builders and their one parser (natsched.wire.msgids)."""

import pytest

from natsched.wire import msgids as M
from natsched.wire.msgids import Kind

RID = "r-1_x"

BUILT = [
    (M.request(RID), RID, Kind.REQUEST, None),
    (M.admitted(RID), f"{RID}:adm", Kind.ADMITTED, None),
    (M.admitted(RID, 2), f"{RID}:adm:2", Kind.ADMITTED, 2),
    (M.work(RID), f"{RID}:work", Kind.WORK, None),
    (M.work(RID, 3), f"{RID}:work:3", Kind.WORK, 3),
    (M.completion(RID), f"{RID}:done", Kind.COMPLETION, None),
    (M.admission(RID), f"{RID}:admission", Kind.ADMISSION, None),
    (M.admission(RID, queued=True), f"{RID}:queue", Kind.QUEUE, None),
    (M.rescue(RID, 1), f"{RID}:rescue:1", Kind.RESCUE, 1),
    (M.routing(RID), f"{RID}:routing", Kind.ROUTING, None),
    (M.offline(RID), f"{RID}:offline", Kind.OFFLINE, None),
    (M.offline(RID, 2), f"{RID}:offline2", Kind.OFFLINE, None),
    (M.offline_decision(RID, "allow", 1, 1), f"{RID}:offline", Kind.OFFLINE, None),
    (M.offline_decision(RID, "retry", 2, 3), f"{RID}:offline-retry2-3", Kind.OFFLINE, None),
    (M.dead(RID), f"{RID}:dead", Kind.DEAD, None),
]


@pytest.mark.parametrize(("built", "expected", "kind", "attempt"), BUILT)
def test_every_builder_writes_the_documented_id_and_parses_back(built, expected, kind, attempt):
    assert built == expected  # the bytes on the wire are what they were before the builders
    parsed = M.parse(built)
    assert parsed is not None and parsed.request_id == RID and parsed.kind is kind
    assert parsed.attempt == attempt
    assert str(parsed) == built  # a round trip
    assert M.request_of(built) == RID


def test_every_stage_of_one_request_has_its_own_id():
    ids = [b for b, *_ in BUILT if b != f"{RID}:offline"]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("bad", ["", "a.b:adm", "r1:", "r1:ADM", "r1:nosuchstage", "r 1", "r1:1"])
def test_ids_this_module_did_not_build_do_not_parse(bad):
    assert M.parse(bad) is None


def test_a_foreign_id_still_names_its_request_for_the_audit():
    from natsched.audit.records import matches

    assert matches(M.work(RID, 4), {RID}) and not matches(M.work("other"), {RID})
