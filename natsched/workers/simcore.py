"""A calibrated model of one vLLM engine, in virtual time: pure, no I/O, no clock.

What it models (vLLM v1 semantics, simplified where the scheduler cannot tell the difference):
- continuous batching: every step decodes one token for each running sequence and spends the
  rest of the ``max_num_batched_tokens`` budget on chunked prefill, oldest first;
- a prefix cache in blocks keyed by the cluster's chained block hashes: a new sequence reuses
  its longest cached prefix (never the last prompt token, as in vLLM), fully computed prompt
  blocks become cached, blocks nobody references stay cached until evicted in LRU order;
- finite KV: a sequence is admitted only when its prompt blocks fit; a decode that cannot get
  a block preempts the youngest sequence (recompute, as vLLM does);
- step time from the :class:`~natsched.workers.profiles.EngineProfile` roofline, divided by a
  runtime ``speed`` factor (1.0 nominal; 1/3 is a noisy neighbour or a throttled GPU): the
  scenario suite slows and restores a worker through it while the run goes on;
- optionally a **host tier** (vLLM's CPU offloading, LMCache): ``host_blocks`` blocks of host
  memory that keep what the GPU evicts, in their own LRU. A new sequence whose prefix continues
  in the host tier loads those blocks (they take GPU blocks as computed ones would) at
  ``host_bandwidth`` bytes/s instead of recomputing them; the load is added to that step's
  duration (it precedes the prefill of the rest). Host copies stay when loaded back, so a block
  may be in both tiers. ``StepResult.host_stored`` / ``host_removed`` report the tier's changes.

``step(now)`` returns how long the step takes and what happened; the live ``SimEngine`` sleeps
that long in real time, the simulator advances its virtual clock by it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

from natsched.workers.profiles import EngineProfile


@dataclass(eq=False)  # identity, not field-by-field: `seq in running` is on the hot path
class SimSeq:
    id: str
    prompt_tokens: int
    hashes: list[int]
    output_tokens: int  # how many tokens this sequence will generate
    arrival: float
    generated: int = 0
    computed: int = 0  # prompt(+recomputed output) tokens whose KV exists
    target: int = 0  # tokens to prefill before decoding (prompt, or more after preemption)
    cached_tokens: int = 0  # prefix tokens served from cache at (first) admission
    held: list[int] = field(default_factory=list)  # cached-block hashes this seq references
    anon_blocks: int = 0  # blocks it holds that carry no shareable hash
    first_token_at: float | None = None
    admitted_once: bool = False
    host_cached_tokens: int = 0  # of ``cached_tokens``, those loaded from the host tier

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV this sequence holds (after a preemption, output is part of ``target``)."""
        return self.computed if self.computed < self.target else self.prompt_tokens + self.generated


@dataclass
class StepResult:
    duration: float
    tokens: list[tuple[str, int]]  # (seq id, index of the token produced)
    finished: list[SimSeq]
    stored: list[int]
    removed: list[int]
    preempted: int = 0
    host_stored: list[int] = field(default_factory=list)  # blocks the host tier took (GPU evictions)
    host_removed: list[int] = field(default_factory=list)  # blocks the host tier evicted


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class SimCore:
    """One engine's batch, KV blocks and prefix cache."""

    def __init__(
        self,
        profile: EngineProfile,
        block_size: int,
        kv_blocks: int | None = None,
        max_num_seqs: int | None = None,
        max_batched_tokens: int | None = None,
        speed: float = 1.0,
        host_blocks: int = 0,
        host_bandwidth: float = 0.0,
    ) -> None:
        if host_blocks < 0 or (host_blocks and host_bandwidth <= 0):
            raise ValueError("host tier: host_blocks >= 0, and host_bandwidth > 0 when it has blocks")
        self.profile = profile
        self.speed = speed  # runtime factor on every step's duration (see set_speed)
        self.block_size = block_size
        self.kv_blocks = kv_blocks if kv_blocks is not None else profile.kv_blocks(block_size)
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.max_batched_tokens = max_batched_tokens or profile.max_num_batched_tokens
        self.free = self.kv_blocks
        self.refs: dict[int, int] = {}  # cached hash -> number of running seqs holding it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, LRU first
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.seqs: dict[str, SimSeq] = {}
        self.busy_time = 0.0
        self.preemptions = 0
        self.host_blocks = host_blocks
        self.host_bandwidth = host_bandwidth  # bytes/s from host memory into the GPU's KV
        self.host: OrderedDict[int, None] = OrderedDict()  # host-tier blocks, LRU first
        self._host_stored: list[int] = []
        self._host_removed: list[int] = []
        self._load_s = 0.0  # host-tier loads of the current step
        self.set_speed(speed)

    def set_speed(self, speed: float) -> None:
        """Run at ``speed`` x the profile's rate from the next step on (1.0 nominal, > 0)."""
        if not speed > 0 or speed != speed or speed == float("inf"):
            raise ValueError(f"speed must be a positive finite factor, got {speed!r}")
        self.speed = float(speed)

    # --- queries ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def used_blocks(self) -> int:
        return self.kv_blocks - self.free - len(self.evictable)

    def runtime_tokens(self) -> int:
        """KV held by running sequences plus prefill still owed by waiting ones."""
        held = sum(s.kv_tokens for s in self.running)
        return held + self.queued_prefill_tokens()

    def queued_prefill_tokens(self) -> int:
        return sum(s.target - s.computed for s in self.waiting) + sum(
            s.target - s.computed for s in self.running if s.computed < s.target
        )

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.refs and h not in self.evictable:
                break
            n += 1
        return n

    def fits(self, prompt_tokens: int, output_tokens: int) -> bool:
        """Whether one sequence alone can ever complete (vLLM refuses longer ones up front)."""
        return _ceil(prompt_tokens + output_tokens, self.block_size) <= self.kv_blocks

    def cached_hashes(self) -> list[int]:
        return list(self.refs) + list(self.evictable)

    # --- requests -----------------------------------------------------------------------
    def add(self, seq_id: str, prompt_tokens: int, hashes: Sequence[int], output_tokens: int, now: float) -> SimSeq:
        seq = SimSeq(seq_id, max(1, prompt_tokens), list(hashes), max(1, output_tokens), now)
        if not self.fits(seq.prompt_tokens, seq.output_tokens):
            raise ValueError(f"sequence {seq_id} needs more than the engine's {self.kv_blocks} KV blocks")
        seq.target = seq.prompt_tokens
        self.seqs[seq_id] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, seq_id: str) -> bool:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return False
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        else:
            self.waiting.remove(seq)
        return True

    # --- blocks -------------------------------------------------------------------------
    def _take(self, n: int, removed: list[int]) -> bool:
        """Make ``n`` blocks free-and-taken, evicting unreferenced cached blocks LRU-first."""
        if self.free + len(self.evictable) < n:
            return False
        while self.free < n:
            h, _ = self.evictable.popitem(last=False)
            removed.append(h)
            self.free += 1
            if self.host_blocks:
                self._to_host(h)
        self.free -= n
        return True

    def _to_host(self, h: int) -> None:
        """A block the GPU evicts is kept in the host tier (most recent), evicting its LRU."""
        host = self.host
        if h in host:
            host.move_to_end(h)
            return
        host[h] = None
        self._host_stored.append(h)
        while len(host) > self.host_blocks:
            old, _ = host.popitem(last=False)
            self._host_removed.append(old)

    def host_prefix_blocks(self, hashes: Sequence[int], start: int) -> int:
        """Blocks of ``hashes`` after the first ``start`` that continue the prefix in the host tier."""
        n = 0
        host = self.host
        for h in hashes[start:]:
            if h not in host:
                break
            n += 1
        return n

    def _release(self, seq: SimSeq) -> None:
        # tail first, as vLLM frees them: the LRU evicts a prefix's deepest blocks before its
        # root, so a partial eviction leaves a shorter shared prefix instead of none
        for h in reversed(seq.held):
            left = self.refs[h] - 1
            if left:
                self.refs[h] = left
            else:
                del self.refs[h]
                self.evictable[h] = None
        self.free += seq.anon_blocks
        seq.held, seq.anon_blocks = [], 0

    def _admit(self, seq: SimSeq, removed: list[int]) -> bool:
        bs = self.block_size
        most = (seq.target - 1) // bs
        matched = min(self.cached_prefix_blocks(seq.hashes), most)
        loaded = min(self.host_prefix_blocks(seq.hashes, matched), most - matched) if self.host else 0
        need = _ceil(seq.target, bs) - matched
        reused_idle = sum(1 for h in seq.hashes[:matched] if h in self.evictable)
        if self.free + len(self.evictable) - reused_idle < need:
            return False  # checked first: evicting for this seq must never evict its own prefix
        for h in seq.hashes[matched:matched + loaded]:
            self.host.move_to_end(h)  # most recent: what the GPU evicts below must not push them out
        for h in seq.hashes[:matched]:
            if h in self.evictable:
                del self.evictable[h]
                self.refs[h] = 1
            else:
                self.refs[h] += 1
        self._take(need, removed)
        if loaded:
            loaded = min(loaded, self.host_prefix_blocks(seq.hashes, matched))
        seq.held = list(seq.hashes[:matched])
        seq.anon_blocks = need
        seq.computed = matched * bs
        if loaded:  # host blocks are copied into freshly taken GPU blocks, then count as computed
            self._load_s += loaded * bs * self.profile.kv_bytes_per_token / self.host_bandwidth
            before = seq.computed
            seq.computed += loaded * bs
            self._register_computed(seq, before, self._loaded_stored)
        if not seq.admitted_once:
            seq.cached_tokens = seq.computed
            seq.host_cached_tokens = loaded * bs
            seq.admitted_once = True
        return True

    def _register_computed(self, seq: SimSeq, before: int, stored: list[int]) -> None:
        """Prompt blocks completed this step become shareable cache entries."""
        bs = self.block_size
        first, last = before // bs, min(seq.computed, seq.prompt_tokens) // bs
        for i in range(max(first, len(seq.held)), min(last, len(seq.hashes))):
            h = seq.hashes[i]
            if h in self.refs:
                self.refs[h] += 1
                self.free += 1  # our copy is redundant: share the existing block
            elif h in self.evictable:
                del self.evictable[h]
                self.refs[h] = 1
                self.free += 1
            else:
                self.refs[h] = 1
                stored.append(h)
            seq.anon_blocks -= 1
            seq.held.append(h)

    # --- one engine step ------------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        removed: list[int] = []
        stored: list[int] = []
        self._loaded_stored = stored
        tokens: list[tuple[str, int]] = []
        finished: list[SimSeq] = []
        preempted = self._grow_decode_blocks(removed)
        budget = self.max_batched_tokens
        decoding = [s for s in self.running if s.computed >= s.target]
        budget -= len(decoding)
        prefill_s = 0.0
        for seq in self.running:
            if seq.computed < seq.target and budget > 0:
                prefill_s += self._prefill(seq, budget, stored)
                budget = self.max_batched_tokens - len(decoding) - self._spent
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, removed):
                break
            self.waiting.popleft()
            self.running.append(seq)
            prefill_s += self._prefill(seq, budget, stored)
            budget = self.max_batched_tokens - len(decoding) - self._spent
        self._spent = 0
        kv_read = sum(s.kv_tokens for s in self.running)
        loading, self._load_s = self._load_s, 0.0
        work = decoding or prefill_s or loading
        duration = (self.profile.step_seconds(prefill_s, kv_read) + loading) / self.speed if work else 0.0
        end = now + duration
        for seq in self.running:
            if seq in decoding or seq.computed >= seq.target:
                tokens.append((seq.id, seq.generated))
                if seq.first_token_at is None:
                    seq.first_token_at = end
                seq.generated += 1
                if seq.generated >= seq.output_tokens:
                    finished.append(seq)
        for seq in finished:
            self.running.remove(seq)
            self._release(seq)
            self.seqs.pop(seq.id, None)
        self.busy_time += duration
        host_stored, host_removed = self._host_stored, self._host_removed
        if host_stored or host_removed:
            self._host_stored, self._host_removed = [], []
        return StepResult(duration, tokens, finished, stored, removed, preempted, host_stored, host_removed)

    _spent = 0
    _loaded_stored: list[int] = []

    def _prefill(self, seq: SimSeq, budget: int, stored: list[int]) -> float:
        n = min(budget, seq.target - seq.computed)
        if n <= 0:
            return 0.0
        before = seq.computed
        seconds = self.profile.prefill_seconds(n, before)
        seq.computed += n
        self._spent += n
        self._register_computed(seq, before, stored)
        return seconds

    def _grow_decode_blocks(self, removed: list[int]) -> int:
        """Each decoding sequence about to cross a block boundary needs one more block."""
        preempted = 0
        for seq in list(self.running):
            if seq not in self.running or seq.computed < seq.target:
                continue
            # this step's input token sits at position prompt + generated - 1; the blocks
            # allocated at admission cover positions below `target`
            if seq.generated == 0 or (seq.prompt_tokens + seq.generated - 1) % self.block_size != 0:
                continue
            while not self._take(1, removed):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                seq.anon_blocks += 1
        return preempted

    def _preempt(self, seq: SimSeq) -> None:
        """Recompute preemption: drop its KV; it re-queues first and re-prefills prompt+output."""
        self.running.remove(seq)
        self._release(seq)
        seq.target = seq.prompt_tokens + seq.generated
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1
