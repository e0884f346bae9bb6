"""``natsched up --engine vllm-server --vllm-url URL ...``: one worker agent per server, each with
its URL and KV-event endpoint, in flags the worker command takes."""

from __future__ import annotations

import pytest

from natsched.cli.app import build_parser
from natsched.cli.up import up_settings
from natsched.hosting.supervisor import Supervisor


def plan(*flags):
    args = build_parser().parse_args(["up", *flags])
    return [c for c in Supervisor(up_settings(args)).plan("nats://127.0.0.1:4222") if c.name.startswith("worker")]


def test_one_agent_per_server_with_its_url_and_kv_events():
    kids = plan("--engine", "vllm-server", "--vllm-url", "http://a:8000", "--vllm-url", "http://b:8000",
                "--kv-events", "tcp://a:5557", "--kv-events", "tcp://b:5557", "--ignore-eos")
    assert [k.name for k in kids] == ["worker w1", "worker w2"]
    for kid, host in zip(kids, "ab"):
        cmd = kid.args[kid.args.index("--log-level") + 2:]
        parsed = build_parser().parse_args(cmd)  # flags the worker command takes
        assert parsed.engine == "vllm-server" and parsed.url == f"http://{host}:8000"
        assert parsed.kv_events == f"tcp://{host}:5557" and parsed.ignore_eos


def test_a_server_without_kv_events_runs_without_cache_summaries():
    (kid,) = plan("--engine", "vllm-server", "--vllm-url", "http://a:8000")
    assert "--kv-events" not in kid.args and "--url" in kid.args


@pytest.mark.parametrize("flags,match", [
    (["--engine", "vllm-server"], "needs --vllm-url"),
    (["--vllm-url", "http://a:8000"], "needs --engine vllm-server"),
    (["--engine", "vllm-server", "--vllm-url", "http://a:1", "--kv-events", "tcp://a:1", "--kv-events", "tcp://b:1"],
     "more --kv-events"),
])
def test_bad_combinations_are_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        up_settings(build_parser().parse_args(["up", *flags]))
