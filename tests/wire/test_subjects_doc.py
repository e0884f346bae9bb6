"""subjects.md and bus/subjects.py must name exactly the same subjects, streams, consumers, buckets."""

import re
from pathlib import Path

import pytest

from natsched.wire import subjects as S

DOC = (Path(__file__).resolve().parents[2] / "subjects.md").read_text()
TABLES = ("Subjects", "Streams", "Durable consumers", "KV buckets", "Headers")


def _first_column_names() -> set[str]:
    names: set[str] = set()
    for section in re.split(r"^## ", DOC, flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        if title.strip() not in TABLES:
            continue
        for line in body.splitlines():
            m = re.match(r"^\| `([^`]+)` \|", line)
            if m:
                names.add(m.group(1))
    return names


def _constants() -> set[str]:
    prefixes = ("STREAM_", "BUCKET_", "CONSUMER_", "HDR_", "KEY_", "BENCH_")
    consts = {v for k, v in vars(S).items() if k.startswith(prefixes) and isinstance(v, str)}
    consts |= {v for k, v in vars(S).items() if k.endswith("_ALL") and isinstance(v, str)}
    consts.discard(S.CONSUMER_WORKER_PREFIX)  # documented through the worker-<worker> pattern
    return consts


def _render(pattern: str) -> str:
    return re.sub(r"<([a-z_]+)>", lambda m: m.group(1).replace("_", "-").upper(), pattern)


@pytest.mark.parametrize("name", sorted(S.PATTERNS))
def test_every_builder_renders_its_documented_pattern(name):
    pattern = S.PATTERNS[name]
    args = re.findall(r"<([a-z_]+)>", pattern)
    rendered = getattr(S, name)(*[a.replace("_", "-").upper() for a in args])
    assert rendered == _render(pattern)
    assert f"`{pattern}`" in DOC, f"{pattern} is built by natsched.wire.subjects.{name} but not documented"


def test_every_constant_is_documented():
    missing = sorted(c for c in _constants() if f"`{c}`" not in DOC)
    assert not missing, f"in bus/subjects.py but not in subjects.md: {missing}"


def test_every_documented_name_exists_in_code():
    known = _constants() | set(S.PATTERNS.values())
    unknown = sorted(n for n in _first_column_names() if n not in known)
    assert not unknown, f"in subjects.md but not built by bus/subjects.py: {unknown}"


def test_doc_lists_every_stream_and_bucket():
    names = _first_column_names()
    assert set(S.STREAMS) <= names
    assert set(S.BUCKETS) <= names


def test_tokens_reject_subject_syntax():
    for bad in ("a.b", "*", ">", "", "sp ace", "x" * 129):
        with pytest.raises(ValueError):
            S.request("online", bad)


def _section(title: str) -> str:
    for section in re.split(r"^## ", DOC, flags=re.M)[1:]:
        head, _, body = section.partition("\n")
        if head.startswith(title):
            return body
    raise AssertionError(f"subjects.md has no section {title!r}")


def test_every_message_id_suffix_is_documented():
    from natsched.wire import msgids as M

    body = _section("Message ids")
    documented = set(re.findall(r"`<id>:([a-z]+)", body))
    assert documented == {k.value for k in M.Kind if k is not M.Kind.REQUEST}
    for built in (M.admitted("ID", 2), M.work("ID", 2), M.rescue("ID", 2), M.offline_decision("ID", "retry", 1, 2)):
        assert M.parse(built) is not None  # the documented shapes are what the builders write


def test_every_status_value_is_documented():
    from natsched.wire.schema import CompletionStatus, JobStatus, ReplyKind, ReplyStatus

    body = _section("Status values")
    for enum_cls in (ReplyKind, ReplyStatus, CompletionStatus, JobStatus):
        row = next(line for line in body.splitlines() if f"(`{enum_cls.__name__}`)" in line)
        assert set(re.findall(r"`([a-z]+)`", row.split("|")[2])) == {m.value for m in enum_cls}, enum_cls
