"""Bad and hostile input to the gateway, sent with curl: each gets a clear OpenAI-style error object."""

from __future__ import annotations

import argparse
import asyncio
import os

import orjson
import pytest

from natsched.wire import subjects as S
from natsched.wire.schema import Control, Decision
from natsched.cli.gateway import add_parsers as add_gateway_parser, cmd_gateway as gateway_main, settings_from_args
from natsched.gateway.errors import ConfigError
from natsched.gateway.keys import KeyRing
from tests.factories.gateway import ALPHA, BETA, start_gateway
from tests.factories.stack import start_stack

CHAT = "/v1/chat/completions"


@pytest.fixture
async def cluster(bus, nats_url):
    stack = await start_stack(nats_url, workers=1)
    gw = await start_gateway(nats_url, max_body_bytes=4096)
    await gw.wait_for_workers(1)
    try:
        yield stack, gw
    finally:
        await gw.close()
        await stack.close()


async def curl(url: str, *args: str, key: str | None = ALPHA, body: bytes | None = None,
               headers: dict[str, str] | None = None, method: str | None = None) -> tuple[int, dict, bytes]:
    """(status, lower-cased headers, body) of one curl call; ``body`` goes through stdin."""
    cmd = ["curl", "-sS", "-i", "-H", "Expect:", *args]
    if method:
        cmd += ["-X", method]
    if key:
        cmd += ["-H", f"Authorization: Bearer {key}"]
    for name, value in (headers or {}).items():
        cmd += ["-H", f"{name}: {value}"]
    if body is not None:
        cmd += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    proc = await asyncio.create_subprocess_exec(*cmd, url, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate(body)
    assert proc.returncode == 0, err.decode()
    head, _, payload = out.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, hdrs, payload


def error_of(status: int, headers: dict, payload: bytes, expected: int) -> dict:
    """The error object, after checking what every error answer must have."""
    assert status == expected, payload
    assert headers["content-type"].startswith("application/json") and headers["x-request-id"]
    assert b"Traceback" not in payload
    body = orjson.loads(payload)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def chat_body(**fields) -> bytes:
    fields.setdefault("model", "default")
    fields.setdefault("messages", [{"role": "user", "content": "hello"}])
    fields.setdefault("max_tokens", 2)
    return orjson.dumps(fields)


async def test_curl_chat_succeeds_and_carries_x_request_id(cluster):
    _, gw = cluster
    status, headers, payload = await curl(gw.url + CHAT, body=chat_body())
    assert status == 200
    assert orjson.loads(payload)["id"] == "chatcmpl-" + headers["x-request-id"]


async def test_curl_streams_server_sent_events_ending_in_done(cluster):
    _, gw = cluster
    status, headers, payload = await curl(gw.url + CHAT, "-N", body=chat_body(stream=True, max_tokens=3))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in payload.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    deltas = [orjson.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert "".join(deltas).split() == ["tok0", "tok1", "tok2"]


@pytest.mark.parametrize("payload,code", [
    (b"{not json", "invalid_json"),
    (b"", "invalid_json"),
    (b"[1, 2, 3]", "invalid_body"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "invalid_model"),
    (b'{"model": "default", "messages": []}', "invalid_messages"),
    (b'{"model": "default", "messages": "hi"}', "invalid_messages"),
    (b'{"model": "default", "messages": [{"role": "user"}]}', "invalid_messages"),
    (b'{"model": "default", "messages": [{"role": "wizard", "content": "hi"}]}', "invalid_role"),
    (b'{"model": "default", "messages": [{"role": "tool", "content": "42"}]}', "unsupported_role"),
    (b'{"model": "default", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
     "unsupported_content"),
    (b'{"model": "default", "max_tokens": "ten", "messages": [{"role": "user", "content": "hi"}]}',
     "invalid_max_tokens"),
    (b'{"model": "default", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}',
     "invalid_max_tokens"),
    (b'{"model": "default", "n": 3, "messages": [{"role": "user", "content": "hi"}]}', "unsupported_parameter"),
    (b'{"model": "default", "stream": "yes", "messages": [{"role": "user", "content": "hi"}]}', "invalid_type"),
])
async def test_malformed_bodies_get_a_400_naming_the_problem(cluster, payload, code):
    _, gw = cluster
    err = error_of(*await curl(gw.url + CHAT, body=payload), 400)
    assert err["type"] == "invalid_request_error" and err["code"] == code


async def test_completion_prompt_shapes_are_checked(cluster):
    _, gw = cluster
    for prompt, code in (([], "invalid_prompt"), (["a", "b"], "unsupported_parameter"), ([1, -2], "invalid_prompt"),
                         ({"x": 1}, "invalid_prompt")):
        body = orjson.dumps({"model": "default", "prompt": prompt})
        assert error_of(*await curl(gw.url + "/v1/completions", body=body), 400)["code"] == code


@pytest.mark.parametrize("key,auth,code", [
    (None, None, "missing_api_key"),
    ("sk-not-a-key", None, "invalid_api_key"),
    (None, "Basic dXNlcjpwYXNz", "invalid_api_key"),
    (None, "Bearer", "invalid_api_key"),
])
async def test_missing_or_unknown_keys_get_401(cluster, key, auth, code):
    _, gw = cluster
    headers = {"Authorization": auth} if auth else None
    err = error_of(*await curl(gw.url + CHAT, key=key, headers=headers, body=chat_body()), 401)
    assert err["type"] == "authentication_error" and err["code"] == code
    err = error_of(*await curl(gw.url + "/v1/models", key=key, headers=headers), 401)
    assert err["code"] == code


async def test_unknown_model_is_404(cluster):
    _, gw = cluster
    err = error_of(*await curl(gw.url + CHAT, body=chat_body(model="llama-9000")), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model" and "llama-9000" in err["message"]


async def test_oversize_bodies_get_413_declared_or_chunked(cluster):
    _, gw = cluster
    big = chat_body(messages=[{"role": "user", "content": "x" * 10_000}])
    err = error_of(*await curl(gw.url + CHAT, body=big), 413)
    assert err["code"] == "body_too_large"
    err = error_of(*await curl(gw.url + CHAT, body=big, headers={"Transfer-Encoding": "chunked"}), 413)
    assert err["code"] == "body_too_large"


async def test_unknown_paths_and_methods_answer_json(cluster):
    _, gw = cluster
    assert error_of(*await curl(gw.url + "/v1/engines"), 404)["code"] == "unknown_url"
    assert error_of(*await curl(gw.url + CHAT), 405)["code"] == "method_not_allowed"  # a GET


async def test_a_header_may_lower_the_class_never_raise_it(cluster, bus):
    _, gw = cluster
    err = error_of(*await curl(gw.url + CHAT, key=BETA, headers={"x-natsched-class": "online"},
                               body=chat_body()), 403)
    assert err["code"] == "class_not_allowed"
    err = error_of(*await curl(gw.url + CHAT, headers={"x-natsched-class": "gold"}, body=chat_body()), 400)
    assert err["code"] == "invalid_class"
    status, headers, payload = await curl(gw.url + CHAT, headers={"x-natsched-class": "batch"}, body=chat_body())
    assert status == 200
    audit = [Decision.decode(d) for _, d in await bus.stream_messages(S.STREAM_DECISIONS)]
    assert {(d.cls, d.tenant) for d in audit if d.request_id == headers["x-request-id"]} == {("batch", "alpha")}
    status, headers, payload = await curl(gw.url + CHAT, key=BETA, headers={"x-natsched-class": "offline"},
                                          body=chat_body())
    assert status == 422, payload  # a job, not a completion: OpenAI clients take any 2xx for one
    err = orjson.loads(payload)["error"]
    assert err["code"] == "degraded_to_job" and headers["location"] == f"/v1/natsched/jobs/{err['job_id']}"


async def test_bad_timeout_header_is_refused(cluster):
    _, gw = cluster
    err = error_of(*await curl(gw.url + CHAT, headers={"x-natsched-timeout": "soon"}, body=chat_body()), 400)
    assert err["code"] == "invalid_timeout" and err["param"] == "x-natsched-timeout"


async def test_no_healthy_worker_is_503_with_retry_after(bus, nats_url):
    stack = await start_stack(nats_url, workers=1)
    gw = await start_gateway(nats_url, models=("llama",))
    try:
        await gw.wait_for_workers(1)
        status, headers, payload = await curl(gw.url + CHAT, body=chat_body(model="llama"))
        assert error_of(status, headers, payload, 503)["code"] == "no_healthy_worker"  # announced, nobody serves it
        assert int(headers["retry-after"]) >= 1
        await bus.publish(S.control("w1"), Control(kind="drain", by="test"))
        for _ in range(100):
            if not gw.gateway.models()["default"]:
                break
            await asyncio.sleep(0.05)
        status, headers, payload = await curl(gw.url + CHAT, body=chat_body())
        assert error_of(status, headers, payload, 503)["code"] == "no_healthy_worker"
    finally:
        await gw.close()
        await stack.close()


async def test_healthz_needs_no_key_and_reports_the_bus(cluster):
    _, gw = cluster
    status, headers, payload = await curl(gw.url + "/healthz", key=None)
    assert status == 200 and headers["x-request-id"]
    assert orjson.loads(payload) == {"status": "ok", "bus": "connected", "models": ["default"]}


async def test_open_mode_serves_one_tenant_without_keys(bus, nats_url):
    stack = await start_stack(nats_url, workers=1)
    gw = await start_gateway(nats_url, open_tenant="lab")
    try:
        await gw.wait_for_workers(1)
        status, headers, _ = await curl(gw.url + CHAT, key=None, body=chat_body())
        assert status == 200
        audit = [Decision.decode(d) for _, d in await bus.stream_messages(S.STREAM_DECISIONS)]
        assert {d.tenant for d in audit if d.request_id == headers["x-request-id"]} == {"lab"}
    finally:
        await gw.close()
        await stack.close()


def gateway_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_gateway_parser(sub)
    return parser.parse_args(["gateway", "--nats-url", "nats://127.0.0.1:1", *argv])


def test_without_keys_the_gateway_refuses_to_start_unless_insecure_open(capsys):
    assert gateway_main(gateway_args()) == 2
    assert "--insecure-open" in capsys.readouterr().err
    settings, keys = settings_from_args(gateway_args("--insecure-open", "--open-tenant", "lab"))
    assert keys.is_open and keys.open_principal.tenant == "lab" and settings.port == 8000


@pytest.mark.parametrize("content,needle", [
    (b"{oops", "not JSON"),
    (b'["sk-1"]', "must be an object"),
    (b'{"sk-1": {"tenant": "a.b"}}', "valid subject token"),
    (b'{"sk-1": {"tenant": "a", "class": "gold"}}', "'class' must be one of"),
    (b'{"sk-1": {"tenant": "a", "role": "admin"}}', "unknown field"),
    (b'{"sha256:abc": {"tenant": "a"}}', "64 hex digits"),
])
def test_bad_keys_files_are_refused_with_the_reason(tmp_path, content, needle):
    path = tmp_path / "keys.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        settings_from_args(gateway_args("--keys", str(path)))
    assert needle in str(err.value)
    with pytest.raises(ConfigError) as err:
        settings_from_args(gateway_args("--keys", str(tmp_path / "missing.json")))
    assert "cannot read" in str(err.value)


def test_hashed_keys_work_and_the_secret_need_not_be_on_disk():
    import hashlib

    digest = hashlib.sha256(b"sk-secret-value").hexdigest()
    ring = KeyRing.from_json(orjson.dumps({f"sha256:{digest}": {"tenant": "t1", "class": "batch"}}))
    assert ring.authenticate("Bearer sk-secret-value").tenant == "t1"
    assert os.environ.get("NOT_USED") is None  # (keys never come from the environment)


def test_stream_migrations_default_to_the_producers_and_a_bad_count_is_refused():
    from natsched.client.producer import MIGRATIONS

    settings, _ = settings_from_args(gateway_args("--insecure-open"))
    assert settings.stream_migrations == MIGRATIONS
    assert settings_from_args(gateway_args("--insecure-open", "--stream-migrations", "0"))[0].stream_migrations == 0
    with pytest.raises(ConfigError, match="stream_migrations must be an integer >= 0, got -1"):
        settings_from_args(gateway_args("--insecure-open", "--stream-migrations", "-1"))
