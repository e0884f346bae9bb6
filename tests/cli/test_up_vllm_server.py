"""``natsched up --engine vllm-server --vllm-url URL ...``: one worker agent per server, each with
its URL and KV-event endpoint, in flags the worker command takes."""

from __future__ import annotations

import pytest

from natsched.cli.app import build_parser
from natsched.cli.up import server_settings, up_settings, worker_settings
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


def test_replay_sockets_and_the_leave_time_reach_every_agent():
    kids = plan("--engine", "vllm-server", "--vllm-url", "http://a:8000", "--vllm-url", "http://b:8000",
                "--kv-events", "tcp://a:5557", "--kv-events", "tcp://b:5557", "--kv-replay", "tcp://a:5558",
                "--unreachable-leave", "2.5")
    for kid, replay in zip(kids, ["tcp://a:5558", None]):
        parsed = build_parser().parse_args(kid.args[kid.args.index("--log-level") + 2:])
        assert parsed.kv_replay == replay  # the second server has no replay socket named: none
        settings = worker_settings(parsed, "tiny", None)  # what the worker command gives its agent
        assert settings.unreachable_leave_s == 2.5 and settings.id == kid.name.split()[1]


def test_metrics_pages_the_flavor_and_the_api_key_reach_every_agent(monkeypatch):
    """The key comes from the environment every agent inherits, never from ``up``'s argv (which
    ``ps`` shows every local user), and ``up`` does not copy it into its children's argv."""
    monkeypatch.setenv("NATSCHED_SERVER_API_KEY", "sk-local-123")
    kids = plan("--engine", "vllm-server", "--vllm-url", "http://a:8000", "--vllm-url", "http://b:8000",
                "--vllm-metrics-url", "http://a:9000/metrics", "--flavor", "sglang")
    for kid, metrics in zip(kids, ["http://a:9000/metrics", None]):
        assert "sk-local-123" not in " ".join(kid.args)
        parsed = build_parser().parse_args(kid.args[kid.args.index("--log-level") + 2:])
        got = server_settings(parsed)
        assert (got.metrics_url, got.flavor, got.api_key) == (metrics, "sglang", "sk-local-123")
    monkeypatch.delenv("NATSCHED_SERVER_API_KEY")
    (kid, _) = plan("--engine", "vllm-server", "--vllm-url", "http://a:8000", "--vllm-url", "http://b:8000")
    got = server_settings(build_parser().parse_args(kid.args[kid.args.index("--log-level") + 2:]))
    assert (got.metrics_url, got.flavor, got.api_key) == (None, "vllm", None)


def test_the_worker_command_gives_its_agent_the_leave_time():
    args = build_parser().parse_args(["worker", "--id", "g1", "--engine", "vllm-server", "--url", "http://a:1",
                                      "--unreachable-leave", "0.75"])
    assert worker_settings(args, "tiny", None).unreachable_leave_s == 0.75
    default = build_parser().parse_args(["worker", "--id", "g1", "--engine", "vllm-server", "--url", "http://a:1"])
    assert worker_settings(default, "tiny", None).unreachable_leave_s == 5.0


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_a_bad_leave_time_is_refused_by_the_parser(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--unreachable-leave", value])
    assert "--unreachable-leave" in capsys.readouterr().err


def test_a_server_without_kv_events_runs_without_cache_summaries():
    (kid,) = plan("--engine", "vllm-server", "--vllm-url", "http://a:8000")
    assert "--kv-events" not in kid.args and "--url" in kid.args


@pytest.mark.parametrize("flags,match", [
    (["--engine", "vllm-server"], "needs --vllm-url"),
    (["--vllm-url", "http://a:8000"], "needs --engine vllm-server"),
    (["--engine", "vllm-server", "--vllm-url", "http://a:1", "--kv-events", "tcp://a:1", "--kv-events", "tcp://b:1"],
     "more --kv-events"),
    (["--engine", "vllm-server", "--vllm-url", "http://a:1", "--kv-replay", "tcp://a:2", "--kv-replay", "tcp://b:2"],
     "more --kv-replay"),
    (["--kv-replay", "tcp://a:2"], "--kv-replay needs --engine vllm-server"),
    (["--engine", "vllm-server", "--vllm-url", "http://a:1", "--vllm-metrics-url", "http://a:2/metrics",
      "--vllm-metrics-url", "http://b:2/metrics"], "more --vllm-metrics-url"),
    (["--flavor", "sglang"], "--flavor needs --engine vllm-server"),
    (["--engine", "sim", "--kv-events", "tcp://a:1"], "--kv-events needs --engine vllm-server"),
])
def test_bad_combinations_are_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        up_settings(build_parser().parse_args(["up", *flags]))
