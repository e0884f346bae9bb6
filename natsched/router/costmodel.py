"""How long work takes on a worker: the router's small, explicit performance model.

Every routing policy that reasons in *time* (``natsched``, ``preble_e2``) uses this one object, so
changing the hardware profile changes them all alike. Pure, no I/O.

Default numbers: one H100 80 GB SXM serving an 8B Llama-3-class model in bf16, from the
arithmetic in ARCHITECTURE.md ("Default engine profile"):

- prefill: ~2 x 8e9 FLOPs/token plus attention, at ~60 % of 989 TFLOP/s  -> ~35k tokens/s;
- decode step: weights (16 GB) / (~80 % of 3.35 TB/s)                     -> ~6 ms,
  plus the KV of every running sequence: 128 KiB/token                    -> ~0.05 ms per 1k tokens;
- KV room ~400k tokens; vLLM's default ``max_num_seqs`` is 256;
- a host-tier KV hit (vLLM CPU offloading, LMCache) is loaded, not recomputed: ~50 GB/s of
  effective PCIe Gen5 x16 over 128 KiB/token -> ~400k tokens/s, ~10x cheaper than a prefill.

These constants are the *fixed* model. Routing uses, per worker, the model learned from that
worker's completions (:mod:`natsched.router.learned`), which starts from them (or from a stored
calibration) and replaces ``prefill_tokens_per_s``, ``attention_ctx_tokens``, ``ttft_overhead_s``
and the decode terms with fitted values; the fields below are therefore the whole interface.
"""

from __future__ import annotations

from dataclasses import dataclass

from natsched.router.errors import ConfigError
from natsched.router.policy import WorkerView


@dataclass(frozen=True)
class CostModel:
    """Prefill throughput and decode step time of one worker (see module docstring for sources)."""

    prefill_tokens_per_s: float = 35_000.0  # uncached prompt tokens per second
    decode_step_s: float = 0.006  # one decode step with an empty batch (weights read)
    decode_s_per_1k_ctx: float = 0.00005  # extra step time per 1k KV tokens in the batch
    kv_capacity_tokens: int = 400_000  # used when a heartbeat does not say (capacity 0)
    max_running: int = 256  # vLLM max_num_seqs: the batch slots of one engine
    typical_output_tokens: int = 256  # remaining decode of a running request, when unknown
    # attention: 4 x layers x d_model FLOPs per token per token of context, against 2 x params
    # for the weights: they are equal at 2 x 8e9 / (4 x 32 x 4096) ~ 30.5k tokens of context
    attention_ctx_tokens: float = 30_500.0
    # fitted by the learned model; 0 in the fixed one (its numbers above have no such terms)
    ttft_overhead_s: float = 0.0  # first-token overhead of a request (at least one engine step)
    decode_s_per_seq: float = 0.0  # extra step time per running sequence (sampling, scheduling)
    host_tokens_per_s: float = 400_000.0  # KV tokens/s loaded from a host tier (see the docstring)

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_step_s <= 0 or self.max_running <= 0:
            raise ConfigError("cost model rates must be positive")
        if self.host_tokens_per_s <= 0 or self.ttft_overhead_s < 0 or self.decode_s_per_seq < 0:
            raise ConfigError("cost model: host_tokens_per_s > 0, ttft_overhead_s and decode_s_per_seq >= 0")

    def prefill_s(self, tokens: float) -> float:
        """Seconds to prefill ``tokens`` uncached prompt tokens."""
        return tokens / self.prefill_tokens_per_s

    def prefill_ctx_s(self, tokens: float, ctx_start: float = 0.0) -> float:
        """Seconds to prefill ``tokens`` after ``ctx_start`` cached ones, attention included.

        Each new token attends to everything before it, so a long prompt costs more per token
        (x2 at ~30k tokens of mean context for the default model): the tail of the latency
        distribution is made of exactly such prompts.
        """
        if tokens <= 0:
            return 0.0
        return tokens / self.prefill_tokens_per_s * (1.0 + (ctx_start + tokens / 2.0) / self.attention_ctx_tokens)

    def first_token_s(self, tokens: float, ctx_start: float = 0.0, host_tokens: float = 0.0) -> float:
        """Seconds from the start of this request's prefill to its first token: the overhead, the
        uncached ``tokens`` after ``ctx_start`` cached ones, and ``host_tokens`` of those cached
        ones that must first be loaded from a host tier."""
        return self.ttft_overhead_s + self.prefill_ctx_s(tokens, ctx_start) + self.host_load_s(host_tokens)

    def host_load_s(self, tokens: float) -> float:
        """Seconds to load ``tokens`` of KV from the host tier into GPU memory."""
        return tokens / self.host_tokens_per_s if tokens > 0 else 0.0

    def step_s(self, ctx_tokens: float, seqs: float = 0.0) -> float:
        """Seconds of one decode step while ``ctx_tokens`` KV tokens of ``seqs`` sequences are in the batch."""
        return self.decode_step_s + self.decode_s_per_1k_ctx * ctx_tokens / 1000.0 + self.decode_s_per_seq * seqs

    # --- worker-level estimates (what the heartbeat plus our own assignments say) ---

    def capacity_tokens(self, w: WorkerView) -> float:
        """KV tokens the worker can hold: its own report, else its block count, else the profile."""
        if w.capacity_tokens > 0:
            return float(w.capacity_tokens)
        if w.kv_total_blocks > 0:
            return float(w.kv_total_blocks * w.block_size)
        return float(self.kv_capacity_tokens)

    def utilisation(self, w: WorkerView) -> float:
        """Busy fraction in [0, 1]: the larger of KV occupancy and batch-slot occupancy.

        Both saturate a vLLM engine: KV full means new requests wait for memory; slots full means
        they wait for a place in the batch.
        """
        kv = w.load_tokens / self.capacity_tokens(w)
        slots = w.inflight / self.max_running
        u = kv if kv > slots else slots
        return 1.0 if u > 1.0 else u

    def backlog_s(self, w: WorkerView) -> float:
        """Seconds of prefill already queued ahead of a new request on ``w``."""
        return self.prefill_s(w.queued_prefill_tokens + w.pending_prefill_tokens)

    def wait_s(self, w: WorkerView, now: float) -> float:
        """Seconds a new request waits on ``w`` *now* for the prefill queued ahead of it.

        From the router's busy-until estimate (:mod:`natsched.router.backlog`) when it has one, else from
        the token counts (:meth:`backlog_s`).
        """
        if w.busy_until is None:
            return self.backlog_s(w)
        wait = w.busy_until - now
        return wait if wait > 0.0 else 0.0

    def batch_kv_tokens(self, w: WorkerView) -> float:
        """KV tokens in ``w``'s running batch: its used blocks, plus what we assigned since."""
        return float(w.kv_used_blocks * w.block_size + w.pending_tokens)

    def decode_s(self, w: WorkerView, output: float, need: float) -> float:
        """Seconds to decode ``output`` tokens on ``w`` for a request holding ``need`` KV tokens."""
        return output * self.step_s(self.batch_kv_tokens(w) + need, w.inflight + 1)

    def kv_wait_s(self, w: WorkerView, need_tokens: float, ctx: float | None = None) -> float:
        """Seconds a request needing ``need_tokens`` of KV waits for room on ``w``.

        Coarse on purpose: if the worker would overflow by ``over`` tokens, freeing them takes
        ``over / capacity`` of a typical request's remaining decode time.
        """
        cap = self.capacity_tokens(w)
        if ctx is None:
            ctx = w.load_tokens
        over = ctx + need_tokens - cap
        if over <= 0:
            return 0.0
        drain_s = self.typical_output_tokens * self.step_s(ctx)
        return over / cap * drain_s

    def finish_s(self, w: WorkerView, uncached: float, prompt: float, output: float) -> float:
        """Estimated seconds until a new request finishes on ``w``.

        = prefill queued ahead + its own uncached prefill + its decode (steps slowed by every
        running sequence's KV) + waiting for KV room. Only *uncached* tokens cost prefill, which
        is where the cache pays off.
        """
        ctx = w.load_tokens
        need = prompt + output
        tps = self.prefill_tokens_per_s
        step = self.decode_step_s + self.decode_s_per_1k_ctx * (ctx + need) / 1000.0
        if self.decode_s_per_seq:
            step += self.decode_s_per_seq * (w.inflight + 1)
        est = (w.queued_prefill_tokens + w.pending_prefill_tokens + uncached) / tps + output * step
        est += self.ttft_overhead_s
        if w.capacity_tokens <= 0 or ctx + need > w.capacity_tokens:  # rare: maybe no KV room
            est += self.kv_wait_s(w, need, ctx)
        return est
