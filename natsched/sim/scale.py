"""``natsched bench scale``: partitioned admission in a discrete-event simulation.

What it models, and why each part is there:

- **One usage key per partition, changed by compare-and-swap.** Each partition's admitter
  replicas read the key, decide a batch, and write it back conditionally; a write that finds the
  key changed since its read is a *conflict*: read and decide again. This is what serialises
  admission today (one key for the cluster) and what partitions spread.
- **Streams are served one operation at a time, servers have cores.** A KV bucket is one
  JetStream stream; its writes are ordered by the stream, so each partition keeps its usage in a
  bucket of its own, and a stream's operations queue on the server that leads it (``servers``,
  each with ``cores`` that all its streams share). The per-operation costs default to what
  ``natsched bench shared`` measured on one server (docs/fleet.md).
- **The hierarchical budget is the real one** (:mod:`natsched.admitter.budget`): a coordinator
  replans every ``rebalance_s`` from what the partitions report, partitions apply the plan they
  last read at their next commit, and the coordinator can be killed: its successor takes over
  after the lease runs out. Over-admission is measured against the cluster total at every event.

Every partition has a backlog (the benchmark measures the most commits per second admission can
make, not a latency at some load), and requests hold their runtime tokens for a random time
before they are released (another commit). Deterministic for a seed.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from natsched.admitter.budget import BudgetPlan, PartitionState, next_plan, partition_of
from natsched.admitter.quotas import Quotas, TenantQuota
from natsched.stats import percentile


SAMPLE_S = 0.01


@dataclass(frozen=True)
class ScaleSettings:
    partitions: int = 1
    replicas: int = 2  # admitter replicas per partition
    servers: int | None = None  # JetStream servers the partitions' streams spread over (default: one per partition)
    cores: int = 2  # per server
    tenants: int = 64
    floors: int = 8  # the first N tenants get a floor each of 0.5 / N of the total
    # tokens are plentiful, so what binds is the commit path (the benchmark's question): 10,000
    # requests in flight at once, held a quarter of a second, allow 40,000 admissions a second
    total: int = 10_000_000
    request_tokens: int = 1_000  # runtime tokens per request
    hold_s: float = 0.25  # mean time a request holds its tokens (exponential)
    batch: int = 1  # requests decided per commit: 1 measures raw commits, as bench shared does
    rtt_s: float = 0.00025  # client <-> server round trip (loopback)
    read_s: float = 0.00002  # server time of a KV get
    write_s: float = 0.00005  # server time of a KV update: with the round trip, one replica alone
    #                           commits ~3,300 times a second, as bench shared measured
    decide_s: float = 0.00002  # admitter CPU per request decided
    pull_s: float = 0.0001  # mean wait for a replica's next batch from its pull consumer (exponential)
    rebalance_s: float = 1.0
    lease_s: float = 3.0  # the coordinator's lease: how long a dead one blocks plans
    kill_coordinator_at: float | None = None
    duration_s: float = 20.0
    warmup_s: float = 2.0
    seed: int = 1

    def check(self) -> None:
        for name in ("partitions", "replicas", "cores", "tenants", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.servers is not None and self.servers < 1:
            raise ValueError("servers must be >= 1")
        if not 0 <= self.floors <= self.tenants:
            raise ValueError("floors must be between 0 and the number of tenants")
        if self.duration_s <= self.warmup_s:
            raise ValueError("duration must be longer than the warm-up")


@dataclass
class ScaleResult:
    partitions: int
    commits_per_s: float
    decisions_per_s: float
    conflicts_per_commit: float
    decision_p50_ms: float
    decision_p99_ms: float
    floor_ratio: float  # min over floored tenants of held ÷ floor, time-averaged
    max_held_ratio: float  # most ever held ÷ total: over-admission when > 1
    plans: int


@dataclass
class _Server:
    cores: int
    busy_until: list[float] = field(default_factory=list)

    def serve(self, now: float, cost: float, stream_free: float) -> float:
        """Finish time of one operation: after its stream's previous one, on the first free core."""
        if not self.busy_until:
            self.busy_until = [0.0] * self.cores
        start = max(now, stream_free, min(self.busy_until))
        i = self.busy_until.index(min(self.busy_until))
        self.busy_until[i] = start + cost
        return start + cost


class ScaleSim:
    def __init__(self, s: ScaleSettings) -> None:
        s.check()
        self.s = s
        self.rng = random.Random(s.seed)
        self.quotas = Quotas(total=s.total, tenants={f"t{i}": TenantQuota(floor=0.5 / s.floors)
                                                     for i in range(s.floors)})
        self.tenant_of = [self._partition_tenants(p) for p in range(s.partitions)]
        n_servers = s.servers or s.partitions
        self.servers = [_Server(s.cores) for _ in range(n_servers)]
        self.server_of = [p % n_servers for p in range(s.partitions)]
        self.stream_free = [0.0] * s.partitions
        self.revision = [0] * s.partitions
        self.held = [dict() for _ in range(s.partitions)]  # tenant -> tokens
        self.releasing: list[list[str]] = [[] for _ in range(s.partitions)]  # finished, not yet committed
        self.applied = [0] * s.partitions
        self.epoch = [0] * s.partitions
        self.plan: BudgetPlan | None = None
        self.events: list = []
        self.seq = itertools.count()
        self.commits = self.decisions = self.conflicts = self.plans = 0
        self.latencies: list[float] = []
        self.floor_samples: dict[str, list[float]] = {}
        self.max_held = 0

    def _partition_tenants(self, p: int) -> list[str]:
        return [f"t{i}" for i in range(self.s.tenants) if partition_of(f"t{i}", self.s.partitions) == p]

    # ------------------------------------------------------------------ events
    def at(self, t: float, what: str, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), what, args))

    def run(self) -> ScaleResult:
        s = self.s
        self._replan(0.0)
        for p in range(s.partitions):
            for r in range(s.replicas):
                self.at(self.rng.random() * s.rtt_s, "read", p)
        self.at(s.rebalance_s, "rebalance")
        self.at(s.warmup_s, "sample")
        while self.events:
            t, _, what, args = heapq.heappop(self.events)
            if t > s.duration_s:
                break
            getattr(self, "_on_" + what)(t, *args)
        return self._result()

    def _op(self, t: float, p: int, cost: float) -> float:
        """One KV operation of partition ``p`` sent at ``t``: when its answer is back."""
        arrive = t + self.s.rtt_s / 2
        done = self.servers[self.server_of[p]].serve(arrive, cost, self.stream_free[p])
        self.stream_free[p] = done
        return done + self.s.rtt_s / 2

    def _on_read(self, t: float, p: int, started: float | None = None) -> None:
        back = self._op(t, p, self.s.read_s)
        self.at(back, "decide", p, self.revision[p], started)

    def _on_decide(self, t: float, p: int, revision: int, started: float | None = None) -> None:
        """``started``: when the batch was first decided, if a lost race sent it round again."""
        if self.plan is not None and self.plan.epoch > self.epoch[p]:  # the plan read with the usage
            self.applied[p], self.epoch[p] = self.plan.grant(p), self.plan.epoch
        free = self.applied[p] - sum(self.held[p].values())
        picks = []
        tenants = self.tenant_of[p]
        while tenants and len(picks) < self.s.batch and free >= self.s.request_tokens:
            picks.append(self._pick(p, tenants))
            free -= self.s.request_tokens
        releases = self.releasing[p][:]
        if not picks and not releases:
            self.at(t + 0.001, "read", p)  # nothing fits and nothing to release: look again soon
            return
        decided = t + self.s.decide_s * len(picks)
        back = self._op(decided, p, self.s.write_s)
        self.at(back, "commit", p, revision, picks, releases, t if started is None else started)

    def _pick(self, p: int, tenants: list[str]) -> str:
        """Tenants below their floor first (the admitter core's rule), else any with backlog."""
        held = self.held[p]
        under = [x for x in tenants if x in self.quotas.tenants
                 and held.get(x, 0) < self.quotas.tenants[x].floor * self.s.total]
        return self.rng.choice(under or tenants)

    def _on_commit(self, t: float, p: int, revision: int, picks: list[str], releases: list[str],
                   decided_at: float) -> None:
        if revision != self.revision[p]:
            self.conflicts += 1
            self.at(t, "read", p, decided_at)  # lost the race: read the new value, decide again
            return
        self.revision[p] += 1
        self.commits += 1
        for tenant in releases:  # the completions this replica folded into its write
            self.releasing[p].remove(tenant)
            self.held[p][tenant] -= self.s.request_tokens
        for tenant in picks:
            self.held[p][tenant] = self.held[p].get(tenant, 0) + self.s.request_tokens
            self.at(t + self.rng.expovariate(1 / self.s.hold_s), "release", p, tenant)
        if t >= self.s.warmup_s:
            self.decisions += len(picks)
            self.latencies.extend([t - decided_at] * len(picks))
        self.max_held = max(self.max_held, sum(sum(h.values()) for h in self.held))
        # the next batch comes from the consumer; the usage needs no read: the write returned it
        self.at(t + self.rng.expovariate(1 / self.s.pull_s), "decide", p, self.revision[p])

    def _on_release(self, t: float, p: int, tenant: str) -> None:
        """A finished request: its release rides with the partition's next commit, as the admitter
        folds completions into its batches (the tokens stay held until that write lands)."""
        self.releasing[p].append(tenant)

    def _on_rebalance(self, t: float) -> None:
        s = self.s
        dead = s.kill_coordinator_at is not None and s.kill_coordinator_at <= t < s.kill_coordinator_at + s.lease_s
        if not dead:
            self._replan(t)
        self.at(t + s.rebalance_s, "rebalance")

    def _replan(self, t: float) -> None:
        states = {}
        for p in range(self.s.partitions):
            held = sum(self.held[p].values())
            backlog = self.s.request_tokens * self.s.batch if self.tenant_of[p] else 0
            states[p] = PartitionState(applied=self.applied[p], epoch=self.epoch[p], reserved=held, queued=backlog)
        self.plan = next_plan(self.quotas, self.s.total, states, self.plan, self.s.partitions)
        self.plans += 1

    def _on_sample(self, t: float) -> None:
        """Each floored tenant's held share of its floor, sampled every 10 ms after the warm-up."""
        for tenant, q in self.quotas.tenants.items():
            held = self.held[partition_of(tenant, self.s.partitions)].get(tenant, 0)
            self.floor_samples.setdefault(tenant, []).append(min(1.0, held / (q.floor * self.s.total)))
        self.at(t + SAMPLE_S, "sample")

    def _result(self) -> ScaleResult:
        span = self.s.duration_s - self.s.warmup_s
        ratios = [sum(v) / len(v) for v in self.floor_samples.values()] or [math.nan]
        lat = sorted(self.latencies)
        return ScaleResult(
            partitions=self.s.partitions, commits_per_s=self.commits / self.s.duration_s,
            decisions_per_s=self.decisions / span, conflicts_per_commit=self.conflicts / max(1, self.commits),
            decision_p50_ms=(percentile(lat, 50) or 0.0) * 1e3, decision_p99_ms=(percentile(lat, 99) or 0.0) * 1e3,
            floor_ratio=min(ratios), max_held_ratio=self.max_held / self.s.total, plans=self.plans)


# ---------------------------------------------------------------------------- the benchmark

@dataclass(frozen=True)
class ScaleBenchSettings:
    partitions: tuple[int, ...] = (1, 2, 4, 8)
    replicas: int = 2
    cores: int = 2
    duration_s: float = 8.0
    kill_coordinator_at: float = 4.0  # the failover run kills the coordinator here (lease_s later a successor plans)
    seed: int = 1


def _run(**kw) -> ScaleResult:
    return ScaleSim(ScaleSettings(**kw)).run()


def run_scale_benchmark(b: ScaleBenchSettings, progress=None) -> dict:
    """For each P: commits/s with the partitions' streams led by P servers (a clustered JetStream)
    and by one server of ``cores`` cores (this machine); the floors and over-admission under a
    token-bound load, with and without a coordinator failover. Returns the report as JSON data."""
    if not b.partitions or min(b.partitions) < 1:
        raise ValueError("partitions must be positive integers")
    rows = []
    common = dict(replicas=b.replicas, cores=b.cores, duration_s=b.duration_s, warmup_s=1.0, seed=b.seed)
    fair = dict(total=400_000, hold_s=2.0, batch=64)  # tokens bind: floors and the budget matter
    for p in b.partitions:
        spread = _run(partitions=p, **common)
        one = _run(partitions=p, servers=1, **common)
        fairness = _run(partitions=p, **common, **fair)
        failover = _run(partitions=p, kill_coordinator_at=b.kill_coordinator_at, **common, **fair)
        rows.append({"partitions": p, "spread": spread.__dict__, "one_server": one.__dict__,
                     "fairness": fairness.__dict__, "failover": failover.__dict__})
        if progress is not None:
            print(f"  P={p}: {spread.commits_per_s:,.0f} commits/s spread, {one.commits_per_s:,.0f} on one server",
                  file=progress, flush=True)
    base = rows[0]
    for r in rows:
        k = r["partitions"] / base["partitions"]
        r["scaling_spread"] = r["spread"]["commits_per_s"] / base["spread"]["commits_per_s"] / k
        r["scaling_one_server"] = r["one_server"]["commits_per_s"] / base["one_server"]["commits_per_s"] / k
        r["fairness_error"] = abs(r["fairness"]["floor_ratio"] - base["fairness"]["floor_ratio"])
    return {"settings": b.__dict__ | {"partitions": list(b.partitions)}, "rows": rows}


def scale_table(report: dict) -> str:
    head = (f"{'P':>3} {'commits/s':>10} {'eff.':>5} {'1 server':>9} {'eff.':>5} {'conflicts':>9} "
            f"{'p50 ms':>7} {'p99 ms':>7} {'floors':>7} {'err':>6} {'held/total':>10} {'failover':>9}")
    lines = ["partitioned admission (DES; per-key compare-and-swap, streams queue on their server's cores)", head]
    for r in report["rows"]:
        s, o, f, fo = r["spread"], r["one_server"], r["fairness"], r["failover"]
        lines.append(f"{r['partitions']:>3} {s['commits_per_s']:>10,.0f} {r['scaling_spread']:>5.2f} "
                     f"{o['commits_per_s']:>9,.0f} {r['scaling_one_server']:>5.2f} {s['conflicts_per_commit']:>9.2f} "
                     f"{s['decision_p50_ms']:>7.2f} {s['decision_p99_ms']:>7.2f} {f['floor_ratio']:>7.3f} "
                     f"{r['fairness_error']:>6.3f} {f['max_held_ratio']:>10.3f} {fo['max_held_ratio']:>9.3f}")
    lines.append("eff.: commits/s ÷ (P × P=1's); floors: least floored tenant's held share of its floor; err: its "
                 "distance from P=1; held/total > 1 would be over-admission (failover: the coordinator is killed "
                 "mid-run and replaced after its lease)")
    return "\n".join(lines)
