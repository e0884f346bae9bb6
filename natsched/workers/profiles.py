"""Engine profiles: the constants of the simulated engine, each with its source beside it.

Every number the simulator and ``SimEngine`` use to turn tokens into seconds lives here, so
a reader can check the arithmetic (ARCHITECTURE.md, "Default engine profile").

Model of one engine step (a roofline):
    step = max(compute-bound time, memory-bound time) + fixed overhead
    compute: (2 * params + 4 * layers * d_model * context) FLOPs per prefilled token,
             at ``mfu`` of the accelerator's dense peak
    memory:  weights + KV of every running sequence, read once per step, at ``mbu`` of
             the accelerator's bandwidth
Only uncached prompt tokens cost prefill, and KV capacity is finite, so both of the
scheduler's gains (skipped prefill, balance) stay visible.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineProfile:
    name: str
    description: str
    params: float  # model parameters
    weight_bytes: float  # bytes of weights read per decode step
    layers: int
    kv_heads: int
    head_dim: int
    d_model: int
    kv_dtype_bytes: int
    peak_flops: float  # dense, per accelerator
    bandwidth: float  # bytes/s HBM
    memory_bytes: float
    gpu_memory_utilization: float = 0.9
    mfu: float = 0.6  # share of peak reached by large prefill chunks
    mbu: float = 0.8  # share of bandwidth reached by decode steps
    step_overhead_s: float = 0.002  # scheduler + sampling + launch per step
    max_num_seqs: int = 256  # vLLM's default max_num_seqs
    max_num_batched_tokens: int = 8192  # vLLM's chunked-prefill token budget per step

    @property
    def kv_bytes_per_token(self) -> float:
        """layers × kv_heads × head_dim × 2 (K and V) × bytes per element."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.kv_dtype_bytes

    @property
    def kv_capacity_tokens(self) -> int:
        """What is left for KV after the weights, at the configured memory utilisation."""
        free = self.memory_bytes * self.gpu_memory_utilization - self.weight_bytes
        return max(0, int(free / self.kv_bytes_per_token))

    def kv_blocks(self, block_size: int) -> int:
        """Whole KV blocks of ``block_size`` tokens in :attr:`kv_capacity_tokens` (a partial one is unusable)."""
        return self.kv_capacity_tokens // block_size

    def prefill_seconds(self, tokens: int, context_start: int = 0) -> float:
        """Compute-bound time to prefill ``tokens`` new tokens after ``context_start`` cached ones."""
        if tokens <= 0:
            return 0.0
        mean_ctx = context_start + tokens / 2
        flops = tokens * (2 * self.params + 4 * self.layers * self.d_model * mean_ctx)
        return flops / (self.peak_flops * self.mfu)

    def memory_seconds(self, batch_kv_tokens: int) -> float:
        """Bandwidth-bound time of one step: weights plus every running sequence's KV."""
        return (self.weight_bytes + batch_kv_tokens * self.kv_bytes_per_token) / (self.bandwidth * self.mbu)

    def step_seconds(self, prefill_flops_s: float, batch_kv_tokens: int) -> float:
        return max(prefill_flops_s, self.memory_seconds(batch_kv_tokens)) + self.step_overhead_s


# One H100 80 GB SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3 (NVIDIA H100 datasheet).
# Llama-3-8B: 8.0e9 params, 32 layers, 8 KV heads, head_dim 128, d_model 4096 (model card).
# KV/token = 32*8*128*2*2 = 128 KiB; weights 16 GB; KV room ≈ 80*0.9 - 16 = 56 GB ≈ 430k tokens.
# Decode step ≈ 16 GB / (0.8 * 3.35 TB/s) ≈ 6 ms + 0.05 ms per 1k context tokens in the batch.
H100_LLAMA8B = EngineProfile(
    name="h100-llama8b",
    description="1x H100 80GB SXM, Llama-3-8B-class, bf16 weights and KV",
    params=8.0e9,
    weight_bytes=16.0e9,
    layers=32,
    kv_heads=8,
    head_dim=128,
    d_model=4096,
    kv_dtype_bytes=2,
    peak_flops=989e12,
    bandwidth=3.35e12,
    memory_bytes=80e9,
)

# A 27B-class model (Gemma-2-27B shape: 46 layers, 16 KV heads, head_dim 128, d_model 4608)
# with 4-bit weights (AWQ/GPTQ: ≈ 0.5 byte/param + scales ≈ 14.5 GB) and bf16 KV, on one H100.
# KV/token = 46*16*128*2*2 ≈ 368 KiB: about 3x the 8B model's, so far fewer tokens fit.
# 4-bit GEMMs dequantise on the fly: prefill MFU is lower (≈ 0.45).
H100_27B_INT4 = EngineProfile(
    name="h100-27b-int4",
    description="1x H100 80GB SXM, 27B-class model, 4-bit weights, bf16 KV",
    params=27.0e9,
    weight_bytes=14.5e9,
    layers=46,
    kv_heads=16,
    head_dim=128,
    d_model=4608,
    kv_dtype_bytes=2,
    peak_flops=989e12,
    bandwidth=3.35e12,
    memory_bytes=80e9,
    mfu=0.45,
)

PROFILES = {p.name: p for p in (H100_LLAMA8B, H100_27B_INT4)}
DEFAULT_PROFILE = H100_LLAMA8B.name


def get_profile(name: str) -> EngineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown engine profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
