"""Run a vLLM worker as a child process (tests, benchmarks); its flags are in :mod:`natsched.cli.up`.

``natsched worker --engine vllm --id w1 --model tiny --model-path DIR [--block-size 32]
[--concurrency 8] [--max-model-len 1024] [--kv-cache-blocks N] [--enforce-eager]
[--load-format dummy] [--skip-tokenizer-init] [--ignore-eos] [--deployment NAME]`` prints
``READY worker <id> ...`` once it serves, exits 0 after a drain and 1 when its engine died.
:class:`VllmWorkerProcess` starts it with a fresh session and ``PR_SET_PDEATHSIG`` (no orphaned
engine if the test runner dies), waits for the READY line and stops it with SIGTERM (then
SIGKILL after a grace period).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Sequence

from natsched.hosting.runtime import READY_PREFIX
from natsched.workers.tiny_model import DTYPE as TINY_DTYPE


class VllmWorkerProcess:
    """A vLLM worker in a child process; ``with VllmWorkerProcess(...) as w: ...``.

    It runs ``python -m natsched worker --engine vllm`` with the given flags.
    """

    def __init__(
        self,
        nats_url: str,
        worker_id: str,
        model_path: str | Path,
        model: str = "tiny",
        *,
        concurrency: int = 8,
        block_size: int = 32,
        max_model_len: int | None = 1024,
        kv_cache_blocks: int | None = 256,
        enforce_eager: bool = True,
        load_format: str | None = "dummy",
        dtype: str | None = TINY_DTYPE,
        skip_tokenizer_init: bool = False,
        ignore_eos: bool = True,
        heartbeat: float = 0.5,
        deployment: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_level: str = "info",
    ) -> None:
        flags = ["--nats-url", nats_url, "--id", worker_id, "--model", model, "--model-path", str(model_path),
                 "--concurrency", str(concurrency), "--block-size", str(block_size), "--heartbeat", str(heartbeat)]
        if max_model_len:
            flags += ["--max-model-len", str(max_model_len)]
        if kv_cache_blocks:
            flags += ["--kv-cache-blocks", str(kv_cache_blocks)]
        if enforce_eager:
            flags.append("--enforce-eager")
        if load_format:
            flags += ["--load-format", load_format]
        if dtype:
            flags += ["--dtype", dtype]
        if skip_tokenizer_init:
            flags.append("--skip-tokenizer-init")
        if ignore_eos:
            flags.append("--ignore-eos")
        if deployment:
            flags += ["--deployment", deployment]
        flags += list(extra_args)
        self.args = [sys.executable, "-m", "natsched", "--log-level", log_level, "worker", "--engine", "vllm", *flags]
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    **(env or {})}
        self.worker_id = worker_id
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.ready_line = ""
        self.lines: deque[str] = deque(maxlen=400)  # stdout + stderr tail, for failure messages

    def start(self) -> "VllmWorkerProcess":
        from natsched.bus.server import die_with_parent

        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            bufsize=1, env=self.env, cwd=str(Path(__file__).resolve().parents[2]),
            start_new_session=True, preexec_fn=die_with_parent,
        )
        threading.Thread(target=self._read, daemon=True, name=f"vllm-worker-{self.worker_id}").start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if line.startswith(READY_PREFIX) and not self.ready.is_set():
                self.ready_line = line
                self.ready.set()

    def wait_ready(self, timeout: float = 240.0) -> str:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM worker {self.worker_id} exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM worker {self.worker_id} not ready after {timeout:.0f}s:\n{self.tail()}")
        return self.ready_line

    async def await_ready(self, timeout: float = 240.0) -> str:
        """:meth:`wait_ready` without blocking an event loop."""
        return await asyncio.to_thread(self.wait_ready, timeout)

    def tail(self, n: int = 60) -> str:
        return "\n".join(list(self.lines)[-n:])

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM to the worker (it stops vLLM in order), SIGKILL to its whole session after ``grace_s``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()
        return self.proc.wait(10)

    def _kill_group(self) -> None:
        """Whatever is left of the session (an engine core whose parent was killed)."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "VllmWorkerProcess":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
