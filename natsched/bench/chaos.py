"""``natsched chaos``: requests under SIGKILLs — does anything get lost, run twice or leak?

A fresh local system, every part a real process: a 3-node JetStream cluster (streams and buckets
with 3 replicas), 2 admitter replicas, 2 router replicas and 3 sim workers, all connected to
every node. A producer (:class:`natsched.client.producer.Client`) sends N requests at a steady rate; during
the run one worker, one admitter, one router and one NATS node are each killed with SIGKILL at
a seeded random moment and started again a few seconds later (the same command, the same
worker id, the node on its own data dir so it rejoins). With ``--inline-routing`` the admitters
route in-process and no router runs, so there is no router to kill. Then the run waits (bounded) for every
request's final outcome, waits until what a lost ack brings back has come back (30 s ack_wait
after the last kill), lets the shared state settle (bounded) and reports:

- ``completed`` / ``rejected`` / ``lost`` — a partition of the requests. Completed: the producer
  got the result, or COMPLETIONS holds an ``ok`` record for it. Rejected: it ended otherwise
  with an outcome someone saw — refused by admission, failed after it (``no_worker``, ...), or
  never accepted (the publish failed within its budget). Lost: accepted, yet no final outcome
  at the producer and no completion record. A final reply on its reply subject counts as the
  producer's even if the Client had stopped listening; a ``cancelled`` completion does not count:
  the producer only cancels when it gave up waiting, so it would hide a lost request.
- ``duplicated`` — request ids with more than one COMPLETIONS record, or more than one final
  reply on their reply subject (watched by a separate subscription: the Client returns the
  first and stops listening). Replies from a worker the request was ``rerouted`` away from are
  not counted, as the Client ignores them too. The second source matters: a request run twice
  (a redelivery after its ack was lost) has its second completion deduplicated by JetStream
  (``<id>:done``), but its second result is still published; ``duplicated_completions`` and
  ``duplicated_replies`` say which source each count came from.
- ``max_lease_reclaim_s`` — for the killed worker: the reservations on it are those of the
  requests assigned to it that were unfinished at the kill (seen on ``work.>``, and read back
  from the WORK stream, which keeps un-acked assignments), plus those
  routed to it while it was down (the routers learn of a death only from missing heartbeats;
  ``routed_to_dead_worker`` counts them). The run polls their ``res.<id>`` records in bucket
  ``inflight`` every 0.1 s and takes the time from the kill until the last one is deleted, or
  marked ``moved_from`` the dead worker (rescued: re-run elsewhere under the same
  reservation); one already gone when first looked at is not counted (it had finished, and
  only its ack was still missing). ``reclaim_detail`` splits the two origins. The target is
  ``lease_missed`` (3) heartbeat periods.
- ``leaked_runtime_tokens`` — after settling, ``used`` of the shared aggregate (key ``usage``
  of ``inflight``, decoded as the admitters do) with every request finished; it should be 0.

- ``readmitted_after_completion`` — request ids assigned (``work.>``) after an ``ok``
  completion of theirs (routed after its time), or admitted (``admitted.>``) for an attempt
  above the completed one; it should be 0. ``readmitted_detail`` says what was published.

``--scenario NAME`` picks what goes wrong (:data:`SCENARIOS`): ``kills`` is the one-of-each run
described here; ``worker-restart`` restarts a worker at once, inside its lease (its predecessor's
work must be rescued from the new instance's first heartbeat, not after the ack wait);
``server-restart`` SIGKILLs the only nats-server of a one-node system and starts it again on its
data dir (``--sync`` says whether it fsyncs before acking); ``recovery`` does both. A scenario is
a kill schedule plus *actors*, coroutines run beside the load that add their own report section
and targets: hostile publishers and disconnecting clients join there.

In ``kills``, the workers' restart comes after the lease window: a worker back under the same id before its
lease expired renews it, and its old reservations would then wait for their redelivery. A
restarted service that exits during start-up (e.g. its provisioning timed out while the cluster
recovers) is started again, as ``natsched up`` does; ``kills[].start_attempts`` says how often.
Producer-side facts come from core NATS subscriptions, which miss what is published while the
observer reconnects after its node died: they can under-count, never invent.
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import orjson

from natsched.admitter.usage import Usage
from natsched.wire import subjects as S
from natsched.client.producer import Client, Timeouts, make_request
from natsched.bus.connection import Bus
from natsched.bus.errors import BusError
from natsched.bus.server import DEFAULT_SYNC
from natsched.client.errors import DuplicateRequest, Rejected, RequestFailed, RequestTimeout
from natsched.wire.errors import MessageError
from natsched.wire.schema import Admitted, Assignment, Completion, Heartbeat, Reply
from natsched.hosting.cluster import ClusterSettings, LocalCluster
from natsched.hosting.supervisor import Child, Supervisor, UpSettings
from natsched.bench import hostile
from natsched.wire import fence
from natsched.ops.auth import AuthDir, AuthSettings, init
from natsched.stats import nearest_rank

log = logging.getLogger(__name__)

KINDS = ("worker", "admitter", "router", "node")
SERVER = "server"  # the only nats-server of a one-node scenario, SIGKILLed and restarted on its data dir
COMPLETED, REJECTED, LOST = "completed", "rejected", "lost"
HELD_AT_KILL, ROUTED_WHILE_DOWN = "held_at_kill", "routed_while_down"
# the producer's outcome of one request (prefixes; rejected/failed carry ":<reason>")
P_COMPLETED, P_REJECTED, P_FAILED = "completed", "rejected", "failed"
P_PUBLISH_FAILED, P_TIMEOUT, P_UNFINISHED, P_DUPLICATE_ID = "publish_failed", "timeout", "unfinished", "duplicate_id"
_PRODUCER_FINAL = (P_COMPLETED, P_REJECTED, P_FAILED, P_PUBLISH_FAILED)


@dataclass
class ChaosSettings:
    requests: int = 2000
    rate: float = 50.0  # requests per second, open loop
    seed: int = 1
    tenants: tuple[str, ...] = ("chaos-a", "chaos-b", "chaos-c")
    max_tokens: int = 16
    nodes: int = 3
    admitters: int = 2
    routers: int = 2  # 0 with inline_routing (natsched chaos --inline-routing)
    inline_routing: bool = False  # the admitters route in-process (admitter --route): no router to kill
    workers: int = 3
    time_scale: float = 2.0  # sim engine: ~0.3 s per request, so a killed worker holds some
    heartbeat_s: float = 1.0
    lease_missed: int = 3  # the admitters' default (AdmitterServiceSettings.lease_missed)
    down_s: float = 6.0  # a killed process stays dead this long: past the lease window (see docstring)
    kill_window: tuple[float, float] = (0.1, 0.7)  # kills happen in this share of the sending time
    finish_timeout_s: float = 90.0  # after the last send; redeliveries come after ack_wait (30 s)
    # what a lost ack brings back (a redelivery after the services' 30 s ack_wait) comes back by
    # this long after the last kill: duplicates and leaks it causes show up before the read-back
    redelivery_s: float = 35.0
    settle_timeout_s: float = 30.0  # reconciliation runs every 10 s and repairs drift on its second look
    reclaim_timeout_s: float = 60.0
    ready_timeout_s: float = 60.0
    data_dir: Path | None = None  # None: a temporary dir, deleted afterwards
    child_log_level: str = "warning"
    scenario: str = "kills"  # what goes wrong (SCENARIOS); "kills" is the classic one-of-each
    sync: str = DEFAULT_SYNC  # the nodes' JetStream sync_interval (natsched.bus.server.SYNC_CHOICES)
    #: clients that leave (natsched.bench.abandon): this many mid-stream and as many while waiting
    disconnects: int = 0

    @property
    def send_s(self) -> float:
        return self.requests / self.rate


# --------------------------------------------------------------------------- pure parts

@dataclass(frozen=True)
class Kill:
    kind: str  # worker | admitter | router | node
    name: str  # worker id, admitter/router child name, or node server name
    at_s: float  # after the first request was sent
    restart_s: float


def target_names(settings: ChaosSettings) -> dict[str, list[str]]:
    """What can be killed, named as the supervisor and the cluster name them."""
    def replicas(kind: str, n: int) -> list[str]:
        return [kind] if n == 1 else [f"{kind}-{i}" for i in range(1, n + 1)]

    return {"worker": [f"w{i}" for i in range(1, settings.workers + 1)],
            "admitter": replicas("admitter", settings.admitters), "router": replicas("router", settings.routers),
            "node": [f"n{i}" for i in range(1, settings.nodes + 1)]}


def kill_schedule(seed: int, send_s: float, down_s: float, names: dict[str, list[str]],
                  window: tuple[float, float] = (0.1, 0.7)) -> list[Kill]:
    """One kill per kind, in seeded random order and moments, each in its own slot of the window.

    Slots keep the kills apart, so each failure's effect (a leader election, a lease expiry)
    is not hidden in another's; the window keeps them inside the sending time, with load both
    before and after. The same seed gives the same schedule.
    """
    rng = random.Random(seed)
    kinds = [k for k in KINDS if names.get(k)]
    rng.shuffle(kinds)
    lo, hi = window[0] * send_s, window[1] * send_s
    slot = (hi - lo) / max(1, len(kinds))
    kills = []
    for i, kind in enumerate(kinds):
        at = round(lo + slot * (i + rng.random()), 3)
        kills.append(Kill(kind, rng.choice(names[kind]), at, round(at + down_s, 3)))
    return kills


def _moments(seed: int, send_s: float, n: int, window: tuple[float, float]) -> tuple[random.Random, list[float]]:
    """``n`` seeded moments, each in its own slot of the window (as :func:`kill_schedule`)."""
    rng = random.Random(seed)
    lo, hi = window[0] * send_s, window[1] * send_s
    slot = (hi - lo) / max(1, n)
    return rng, [round(lo + slot * (i + rng.random()), 3) for i in range(n)]


def _worker_restart(s: "ChaosSettings", rng: random.Random, at: float) -> Kill:
    """A worker SIGKILLed and started again at once: back (a process start, ~1-2 s) before its
    lease (3 heartbeats) expires, the case that used to strand its work for the ack wait."""
    return Kill("worker", rng.choice(target_names(s)["worker"]), at, at)


def _server_restart(s: "ChaosSettings", at: float) -> Kill:
    """The only nats-server SIGKILLed and started again on its data dir after ``down_s``."""
    return Kill(SERVER, SERVER, at, round(at + s.down_s, 3))


def _kills_classic(s: "ChaosSettings") -> list[Kill]:
    return kill_schedule(s.seed, s.send_s, s.down_s, target_names(s), s.kill_window)


def _kills_worker_restart(s: "ChaosSettings") -> list[Kill]:
    rng, (at,) = _moments(s.seed, s.send_s, 1, s.kill_window)
    return [_worker_restart(s, rng, at)]


def _kills_server_restart(s: "ChaosSettings") -> list[Kill]:
    _, (at,) = _moments(s.seed, s.send_s, 1, s.kill_window)
    return [_server_restart(s, at)]


def _kills_recovery(s: "ChaosSettings") -> list[Kill]:
    rng, (first, second) = _moments(s.seed, s.send_s, 2, s.kill_window)
    return [_worker_restart(s, rng, first), _server_restart(s, second)]


@dataclass(frozen=True)
class Scenario:
    """What goes wrong in one ``natsched chaos --scenario NAME`` run.

    ``nodes``: the JetStream cluster's size (1: the server itself can be killed, kind ``server``).
    ``kills``: the schedule, from the settings. ``actors``: coroutines run beside the load, each
    ``actor(run, t0) -> dict`` whose result lands in the report under ``actors.<name>`` (and whose
    ``targets`` entry, a dict of name -> bool, joins ``targets_met``): the place for hostile
    publishers and disconnecting clients.
    """

    name: str
    help: str
    nodes: int
    kills: Callable[["ChaosSettings"], list[Kill]]
    actors: tuple[tuple[str, Callable[["ChaosRun", float], Awaitable[dict[str, Any]]]], ...] = ()
    #: run under ``natsched auth init``'s accounts and permissions (the honest load and the
    #: observer connect as the admin; hostile actors with the roles they attack with)
    auth: bool = False
    #: before the load, with the observer's (admin) connection: quotas the scenario needs
    prepare: Callable[["ChaosRun", Bus], Awaitable[None]] | None = None


SCENARIOS: dict[str, Scenario] = {sc.name: sc for sc in (
    Scenario("kills", "one worker, admitter, router and NATS node of a 3-node cluster each SIGKILLed and restarted "
                      "after --down seconds (past the lease)", 3, _kills_classic),
    Scenario("worker-restart", "a worker SIGKILLed and restarted at once, inside its lease", 3,
             _kills_worker_restart),
    Scenario("server-restart", "the only nats-server SIGKILLed and restarted on its data dir", 1,
             _kills_server_restart),
    Scenario("recovery", "worker-restart, then server-restart, in one run on one nats-server", 1, _kills_recovery),
    Scenario("hostile", "under auth init's accounts: a tenant's producer and a worker's credentials attack for the "
                        "whole run (reply-to injection, declared costs, dedup collisions, forged completions); "
                        "reports over-admission", 1, lambda s: [], actors=(("hostile", hostile.hostile),),
             auth=True, prepare=hostile.prepare),
)}


@dataclass
class Facts:
    """What a run observed; :func:`compute_report` turns it into the numbers."""

    requests: list[str]  # every request id sent
    producer: dict[str, str]  # request id -> the producer's outcome (P_* , "rejected:<reason>", ...)
    final_replies: dict[str, list[str]] = field(default_factory=dict)  # request id -> each final reply seen
    completions: dict[str, list[tuple[str, str | None]]] = field(default_factory=dict)  # -> [(status, reason)]
    reclaims: dict[str, float | None] = field(default_factory=dict)  # killed worker -> seconds (None: not measured)
    leaked_runtime_tokens: int | None = None  # None: the usage could not be read
    heartbeat_s: float = 1.0
    lease_missed: int = 3
    readmitted: list[str] = field(default_factory=list)  # admitted or assigned again after an ok completion
    reclaim_expected: bool = True  # a worker was killed: its reclaim is a target (a scenario may kill none)
    #: the reclaim's target when not the lease window: a worker restarted inside its lease is
    #: rescued from its new instance's first heartbeat, so within its time down plus one lease
    reclaim_window_s: float | None = None


def classify(producer: str | None, completions: list[tuple[str, str | None]], finals: Sequence[str] = ()) -> str:
    """completed, rejected or lost (see the module docstring for why each rule).

    ``finals``: the final replies seen on the request's reply subject, which count as the
    producer's even when its Client had stopped listening (it timed out first).
    """
    if producer == P_COMPLETED:
        return COMPLETED
    outcomes = [status for status, reason in completions if reason != "cancelled"]
    if "ok" in outcomes or any(r.startswith("result") for r in finals):
        return COMPLETED
    if outcomes or finals or (producer or "").split(":")[0] in _PRODUCER_FINAL:
        return REJECTED
    return LOST


def duplicated_ids(f: Facts) -> list[str]:
    return [r for r in f.requests if len(f.completions.get(r, [])) > 1 or len(f.final_replies.get(r, [])) > 1]


def max_reclaim(reclaims: dict[str, float | None]) -> float | None:
    """The slowest reclaim; None when one was not measured (a reservation never released, none
    seen on the worker, or no worker killed): a target is never met by default."""
    values = list(reclaims.values())
    if not values or any(v is None for v in values):
        return None
    return max(values)


def compute_report(f: Facts) -> dict[str, Any]:
    """The report's numbers and targets from the collected facts (no I/O)."""
    classes = {r: classify(f.producer.get(r), f.completions.get(r, []), f.final_replies.get(r, []))
               for r in f.requests}
    counts = Counter(classes.values())
    dups = duplicated_ids(f)
    reclaim = max_reclaim(f.reclaims)
    window = f.reclaim_window_s if f.reclaim_window_s is not None else f.lease_missed * f.heartbeat_s
    met = {"lost": counts[LOST] == 0, "duplicated": not dups, "leaked_runtime_tokens": f.leaked_runtime_tokens == 0,
           "readmitted_after_completion": not f.readmitted}
    if f.reclaim_expected:  # a worker was killed: its reservations must be reclaimed (or rescued) in time
        met["max_lease_reclaim_s"] = reclaim is not None and reclaim <= window
    met["all"] = all(met.values())
    return {
        "requests": len(f.requests), "completed": counts[COMPLETED], "rejected": counts[REJECTED],
        "lost": counts[LOST], "duplicated": len(dups), "max_lease_reclaim_s": reclaim,
        "readmitted_after_completion": len(f.readmitted), "readmitted_ids": sorted(f.readmitted)[:20],
        "duplicated_completions": sum(1 for r in f.requests if len(f.completions.get(r, [])) > 1),
        "duplicated_replies": sum(1 for r in f.requests if len(f.final_replies.get(r, [])) > 1),
        "leaked_runtime_tokens": f.leaked_runtime_tokens, "targets_met": met,
        "lease_window_s": window,
        "producer_outcomes": dict(sorted(Counter(f.producer.get(r, P_UNFINISHED) for r in f.requests).items())),
        "completed_without_producer_result": sum(1 for r, c in classes.items()
                                                 if c == COMPLETED and f.producer.get(r) != P_COMPLETED),
        "lost_ids": sorted(r for r, c in classes.items() if c == LOST)[:20],
        "duplicated_ids": dups[:20],
        "detail": _detail(f, [*dups[:20], *(r for r, c in classes.items() if c == LOST)][:40] + _odd_ids(f)),
        "reclaims": f.reclaims,
    }


def _odd_ids(f: Facts, limit: int = 10) -> list[str]:
    """A few request ids of every producer outcome but ``completed``."""
    per: Counter[str] = Counter()
    out = []
    for r in f.requests:
        outcome = f.producer.get(r, P_UNFINISHED)
        if outcome != P_COMPLETED and per[outcome] < limit:
            per[outcome] += 1
            out.append(r)
    return out


def _detail(f: Facts, ids: list[str]) -> dict[str, dict[str, Any]]:
    """What was seen of each odd request (duplicated, lost, not completed at the producer): where
    to start reading with ``natsched audit``."""
    return {r: {"producer": f.producer.get(r, P_UNFINISHED), "completions": f.completions.get(r, []),
                "final_replies": f.final_replies.get(r, [])} for r in dict.fromkeys(ids)}


def format_report(report: dict[str, Any]) -> str:
    """A table, the kills and the targets, for the terminal."""
    cols = ["requests", "completed", "rejected", "lost", "duplicated", "readmitted_after_completion",
            "max_lease_reclaim_s", "leaked_runtime_tokens"]
    cells = [_cell(report.get(c)) for c in cols]
    widths = [max(len(c), len(v)) for c, v in zip(cols, cells)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)), "  ".join(v.rjust(w) for v, w in zip(cells, widths))]
    for k in report.get("kills", []):
        lines.append(f"  killed {k['kind']} {k['name']} at {k.get('killed_at_s')}s, back at {k.get('ready_at_s')}s"
                     + (" (inside its lease)" if k.get("inside_lease") else "")
                     + (f" ({k['error']})" if k.get("error") else ""))
    for worker, d in report.get("reclaim_detail", {}).items():
        held, routed = d[HELD_AT_KILL], d[ROUTED_WHILE_DOWN]
        lines.append(f"  reservations on {worker}: {held['count']} held at the kill (released within "
                     f"{_cell(held['max_s'])}s), {routed['count']} routed to it while down (within "
                     f"{_cell(routed['max_s'])}s), {held['never'] + routed['never']} never released")
    if report.get("e2e_p50_s") is not None:
        lines.append(f"  producer e2e of completed requests: p50 {report['e2e_p50_s']}s, p99 {report['e2e_p99_s']}s, "
                     f"max {report['e2e_max_s']}s")
    hostile_report = report.get("actors", {}).get("hostile")
    if hostile_report and "error" not in hostile_report:
        lines.append(f"  hostile publishers: sent {hostile_report['sent']}; over-admission "
                     f"{hostile_report['over_admission']} (max held / total {hostile_report['total']}), max reserved "
                     f"{hostile_report['max_reserved_ratio']} of it; values no admitter wrote "
                     f"{hostile_report['foreign_values'] or 0}")
    want = {"lost": "0", "duplicated": "0", "leaked_runtime_tokens": "0", "readmitted_after_completion": "0",
            "max_lease_reclaim_s": f"<= {report.get('lease_window_s')}", "over_admission": "<= 1.0",
            "max_reserved_ratio": "<= 1.0", "foreign_values": "none", "attacks_ran": "every attack sent"}
    if "disconnects" in report and "streams" in report["disconnects"]:
        from natsched.bench.abandon import format_abandon

        lines += ["  " + line for line in format_abandon(report["disconnects"])]
        d = report["disconnects"]
        report = {**report, "abandoned_tokens_beyond_one_step": d["streams"]["tokens_beyond_one_step"]
                  + d["waiting"]["tokens_beyond_one_step"],
                  "abandoned_unaccounted": d["streams"]["unaccounted"] + d["waiting"]["unaccounted"]}
        want.update({"abandoned_tokens_beyond_one_step": "0", "abandoned_unaccounted": "0"})
    lines.append(f"targets: (scenario {report.get('scenario', 'kills')})")
    for name, ok in report["targets_met"].items():
        if name != "all":
            got = report.get(name, (hostile_report or {}).get(name))
            lines.append(f"  [{'ok' if ok else 'MISSED'}] {name}: want {want.get(name, 'ok')}, got {_cell(got)}")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


# --------------------------------------------------------------------------- the run

class ChaosRun:
    """Starts the system, drives it, kills and restarts its parts, collects the :class:`Facts`."""

    def __init__(self, settings: ChaosSettings) -> None:
        self.scenario = SCENARIOS[settings.scenario]
        self.s = settings = replace(settings, nodes=self.scenario.nodes)
        self.run_id = uuid.uuid4().hex[:8]
        self.cluster: LocalCluster | None = None
        self.sup: Supervisor | None = None
        self.abandon_report: dict[str, Any] | None = None  # the disconnecting clients' (--disconnects)
        self.ids: list[str] = []
        self.producer: dict[str, str] = {}
        self.e2e: list[float] = []  # seconds from submit to the producer's outcome, completed requests
        self.final_replies: dict[str, list[str]] = defaultdict(list)
        self.abandoned: dict[str, set[str]] = defaultdict(set)  # request id -> workers it was rerouted from
        self.assigned: dict[str, str] = {}  # request id -> worker of its latest assignment
        self.down: dict[str, float] = {}  # killed worker -> when (time.time())
        self.routed_to_dead: Counter[str] = Counter()
        self.seen_workers: set[str] = set()
        self.events: list[dict[str, Any]] = []
        self.reclaim_tasks: dict[str, asyncio.Task] = {}
        # killed worker -> request id -> "held_at_kill" | "routed_while_down": the reservations on it
        self.reclaim_watch: dict[str, dict[str, str]] = {}
        self.reclaim_detail: dict[str, dict[str, Any]] = {}
        self.phases: dict[str, float] = {}  # seconds after the first send when each phase ended
        self.t0 = 0.0
        self._gave_up = False
        # an ok completion was seen for it: (its time, the highest attempt completed)
        self.completed_ok: dict[str, tuple[float, int]] = {}
        self.readmitted: set[str] = set()  # admitted or assigned again after that
        self.readmit_detail: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.actor_reports: dict[str, dict[str, Any]] = {}
        self.auth: AuthDir | None = None  # the scenario runs under auth init's config (Scenario.auth)
        self.forged_stored = 0  # completion records no assigned worker published (see _completions)

    def run(self) -> dict[str, Any]:
        """The whole run; everything started is stopped, whatever happens."""
        tmp = None if self.s.data_dir else Path(tempfile.mkdtemp(prefix="natsched-chaos-"))
        root = Path(self.s.data_dir or tmp)
        try:
            started = time.monotonic()
            self._start(root)
            report = asyncio.run(self._drive())
            report["wall_s"] = round(time.monotonic() - started, 1)
            return report
        finally:
            if self.sup is not None:
                self.sup.stop(quiet=True)
            if self.cluster is not None:
                self.cluster.stop()
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _start(self, root: Path) -> None:
        s = self.s
        secured: dict[str, Any] = {}
        if self.scenario.auth:
            workers = [f"w{i + 1}" for i in range(s.workers)]  # as natsched up names them
            init(AuthSettings(out=root / "auth", tenants=[*s.tenants, hostile.HOSTILE_TENANT], workers=workers))
            self.auth = AuthDir.open(root / "auth")
            secured = {"config_file": self.auth.config, "credentials": self.auth.creds("admin")}
        self.cluster = LocalCluster(ClusterSettings(nodes=s.nodes, base_port=None, data_dir=root / "cluster",
                                                    ready_timeout_s=s.ready_timeout_s, sync=s.sync, **secured))
        self.cluster.start()  # provisions: 3 replicas on 3 nodes
        self.sup = Supervisor(UpSettings(
            workers=s.workers, admitters=s.admitters, routers=s.routers, inline_routing=s.inline_routing,
            engine="sim", nats_url=self.cluster.url,
            time_scale=s.time_scale, log_level=s.child_log_level, ready_timeout_s=s.ready_timeout_s, offline=False,
            log_dir=root / "logs", extra_worker_args=["--heartbeat", str(s.heartbeat_s)],
            auth_dir=self.auth.root if self.auth else None))
        self.sup.start(quiet=True)

    async def _drive(self) -> dict[str, Any]:
        s = self.s
        creds = self.auth.creds("admin") if self.auth else None
        observer = await Bus.connect(self.cluster.url, name="chaos-observer", connect_budget_s=30, credentials=creds)
        producer = await Bus.connect(self.cluster.url, name="chaos-producer", connect_budget_s=30,
                                     publish_budget_s=30, credentials=creds)
        t = s.finish_timeout_s
        client = Client(producer, Timeouts(publish=30.0, admission=t, queued=t, idle=t))
        tasks: list[asyncio.Task] = []
        chaos: list[asyncio.Task] = []
        try:
            await self._observe(observer)
            await self._wait_for_workers()
            if self.scenario.prepare is not None:
                await self.scenario.prepare(self, observer)
            kills = self.scenario.kills(s)
            self.t0 = t0 = time.monotonic()
            chaos = [asyncio.create_task(self._kill_and_restart(k, t0, observer)) for k in kills]
            chaos += [asyncio.create_task(self._act(name, actor, t0)) for name, actor in self.scenario.actors]
            if s.disconnects:
                chaos.append(asyncio.create_task(self._abandon()))
            tasks = await self._send(client, t0)
            self._phase("sent")
            await self._finish(tasks, producer)
            self._phase("outcomes")
            if chaos:
                await asyncio.wait(chaos, timeout=max((k.restart_s for k in kills), default=s.send_s)
                                   + 2 * s.ready_timeout_s)
            self._phase("restarts")
            reclaims = await self._reclaims()
            self._phase("reclaims")
            if kills:
                await asyncio.sleep(max(0.0, t0 + max(k.at_s for k in kills) + s.redelivery_s - time.monotonic()))
            self._phase("redeliveries")
            leaked, leftover = await self._settle(observer)
            self._phase("settled")
            facts = Facts(self.ids, self.producer, dict(self.final_replies), await self._completions(observer),
                          reclaims, leaked, s.heartbeat_s, s.lease_missed, sorted(self.readmitted),
                          reclaim_expected=any(k.kind == "worker" for k in kills),
                          reclaim_window_s=self._restart_window())
            self._phase("read_back")
            return self._report(facts, leftover)
        finally:
            for task in [*tasks, *chaos, *self.reclaim_tasks.values()]:
                task.cancel()
            await producer.close()
            await observer.close()

    def _restart_window(self) -> float | None:
        """With a worker restarted inside its lease: its time down plus one lease (see Facts)."""
        lease = self.s.lease_missed * self.s.heartbeat_s
        downs = [e["ready_at_s"] - e["killed_at_s"] for e in self.events
                 if e["kind"] == "worker" and e.get("inside_lease") and "ready_at_s" in e]
        return round(max(downs) + lease, 2) if downs else None

    async def _act(self, name: str, actor: Callable[["ChaosRun", float], Awaitable[dict[str, Any]]],
                   t0: float) -> None:
        """One scenario actor beside the load; what it reports (or how it failed) is kept."""
        try:
            self.actor_reports[name] = await actor(self, t0)
        except Exception as exc:  # reported, never hidden
            log.exception("chaos actor %s failed", name)
            self.actor_reports[name] = {"error": f"{type(exc).__name__}: {exc}", "targets": {name: False}}

    # --- watching ---------------------------------------------------------------------
    async def _observe(self, bus: Bus) -> None:
        """Assignments (who holds what), final replies (duplicates) and heartbeats (readiness)."""
        async def on_work(subject: str, data: bytes, headers: dict) -> None:
            try:
                a = Assignment.decode(data)
            except MessageError:
                return
            self.assigned[a.request.id] = a.worker
            self._again(a.request.id, subject, headers, routed_at=a.routed_at)
            if a.worker in self.down:
                self.routed_to_dead[a.worker] += 1
                self.reclaim_watch.setdefault(a.worker, {}).setdefault(a.request.id, ROUTED_WHILE_DOWN)

        async def on_reply(subject: str, data: bytes, headers: dict) -> None:
            try:
                reply = Reply.decode(data)
            except MessageError:
                return
            rid = reply.request_id
            if reply.kind == "status" and reply.status == "rerouted" and reply.worker:
                self.abandoned[rid].add(reply.worker)
            elif reply.final and not (reply.worker and reply.worker in self.abandoned.get(rid, ())):
                self.final_replies[rid].append(" ".join(str(x) for x in (reply.kind, reply.status, reply.reason,
                                                                         reply.worker) if x))

        async def on_admitted(subject: str, data: bytes, headers: dict) -> None:
            try:
                adm = Admitted.decode(data)
            except MessageError:
                return
            self._again(adm.request.id, subject, headers, attempt=adm.attempt)

        async def on_completion(subject: str, data: bytes, headers: dict) -> None:
            try:
                c = Completion.decode(data)
            except MessageError:
                return
            if c.status == "ok" and fence.fenced(bus.fence_key, c, subject):  # (a forged one finished nothing)
                first = self.completed_ok.get(c.request_id)
                self.completed_ok[c.request_id] = (min(first[0], c.ts) if first else c.ts,
                                                   max(first[1], c.attempt) if first else c.attempt)

        async def on_heartbeat(subject: str, data: bytes, headers: dict) -> None:
            try:
                self.seen_workers.add(Heartbeat.decode(data).worker)
            except MessageError:
                pass

        await bus.subscribe(S.WORK_ALL, on_work)
        await bus.subscribe("resp.>", on_reply)
        await bus.subscribe(S.HEARTBEATS_ALL, on_heartbeat)
        await bus.subscribe(S.ADMITTED_ALL, on_admitted)
        await bus.subscribe(S.COMPLETIONS_ALL, on_completion)
        await bus.flush()

    def _again(self, rid: str, subject: str, headers: dict | None, *, routed_at: float | None = None,
               attempt: int | None = None) -> None:
        """An admission or assignment of ``rid``: one made after its ok completion is a re-admission
        (what was published is kept for the report's ``readmitted_detail``).

        "After" by what the messages say, not by the order they arrive here: nats-py runs each
        subscription's callbacks in a task of its own, so under load a completion can be handled
        before the hand-off that caused it (a loaded run once counted 7 such "re-admissions"). An
        assignment is later if it was routed after the completion's time (one clock: every
        process of the run is on this machine); an admission if it is of an attempt above the
        completed one (a rescue's: its admitted_at is the first admission's), while a repeat of
        the completed attempt's hand-off can only run again through a new assignment."""
        done = self.completed_ok.get(rid)
        if done is None:
            return
        ok_ts, ok_attempt = done
        if (routed_at is not None and routed_at > ok_ts) or (attempt is not None and attempt > ok_attempt):
            self.readmitted.add(rid)
            self.readmit_detail[rid].append({"subject": subject, "msg_id": (headers or {}).get(S.HDR_MSG_ID),
                                             "after_completion_s": round(routed_at - ok_ts, 3)
                                             if routed_at is not None else None})

    async def _wait_for_workers(self) -> None:
        """Until every worker's heartbeat was seen (the routers see them too), at most 15 s."""
        want = set(target_names(self.s)["worker"])
        deadline = time.monotonic() + 15
        while not want <= self.seen_workers and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if not want <= self.seen_workers:
            log.warning("no heartbeat yet from %s; sending anyway", sorted(want - self.seen_workers))

    # --- the producer -------------------------------------------------------------------
    async def _send(self, client: Client, t0: float) -> list[asyncio.Task]:
        """N requests at the rate, open loop (a slow system does not slow the sender)."""
        tasks = []
        for i in range(self.s.requests):
            delay = t0 + i / self.s.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._submit(client, i)))
        return tasks

    async def _submit(self, client: Client, i: int) -> None:
        rid = f"chaos-{self.run_id}-{i:06d}"
        if self.scenario.auth:  # random, as clients' ids are: predictable ids can be taken (bench.hostile)
            rid += "-" + uuid.uuid4().hex[:8]
        tenant = self.s.tenants[i % len(self.s.tenants)]
        request = make_request(tenant, f"request {i}: summarise the incident report in two lines. " * 3,
                               id=rid, max_tokens=self.s.max_tokens, system_prompt=f"You work for {tenant}.")
        rid = request.id  # in its tenant's scope (natsched.wire.ids.scoped): what every record names
        self.ids.append(rid)
        started = time.monotonic()
        self.producer[rid] = outcome = await self._outcome(client, request)
        if outcome == P_COMPLETED:
            self.e2e.append(time.monotonic() - started)

    async def _outcome(self, client: Client, request) -> str:
        """What the producer learnt about one request (never raises)."""
        try:
            await client.submit(request)
            return P_COMPLETED
        except Rejected as exc:
            return f"{P_REJECTED}:{exc.reason}"
        except RequestFailed as exc:
            return f"{P_FAILED}:{exc.reason}"
        except RequestTimeout:
            return P_TIMEOUT
        except DuplicateRequest:
            return P_DUPLICATE_ID
        except asyncio.CancelledError:
            return P_UNFINISHED
        except Exception as exc:  # the publish was not acknowledged within its budget
            if self._gave_up:
                return P_UNFINISHED
            log.warning("request %s: %s: %s", request.id, type(exc).__name__, exc)
            return P_PUBLISH_FAILED

    async def _finish(self, tasks: list[asyncio.Task], producer: Bus) -> None:
        """Wait (bounded) for every outcome; then stop waiting without telling any worker."""
        _, pending = await asyncio.wait(tasks, timeout=self.s.finish_timeout_s) if tasks else ((), ())
        if pending:
            log.warning("%d requests without an outcome after %.0fs", len(pending), self.s.finish_timeout_s)
            self._gave_up = True
            await producer.close()  # first: a cancelled exchange must not cancel its request on a worker
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=5)

    # --- chaos --------------------------------------------------------------------------
    async def _kill_and_restart(self, kill: Kill, t0: float, observer: Bus) -> None:
        event: dict[str, Any] = {"kind": kill.kind, "name": kill.name}
        self.events.append(event)
        await asyncio.sleep(max(0.0, t0 + kill.at_s - time.monotonic()))
        event["killed_at_s"] = round(time.monotonic() - t0, 2)
        killed_at = time.time()
        self._kill(kill)
        log.info("killed %s %s", kill.kind, kill.name)
        if kill.kind == "worker":
            self._watch_reclaim(kill.name, killed_at, observer)
        await asyncio.sleep(max(0.0, t0 + kill.restart_s - time.monotonic()))
        try:
            await self._restart(kill, event)
        except Exception as exc:  # reported, never hidden
            event["error"] = f"restart failed: {exc}"
            log.error("restarting %s %s failed: %s", kill.kind, kill.name, exc)
        self.down.pop(kill.name, None)
        event["ready_at_s"] = round(time.monotonic() - t0, 2)
        if kill.kind == "worker":  # its first heartbeat goes out before its READY line
            event["inside_lease"] = time.time() - killed_at < self.s.lease_missed * self.s.heartbeat_s

    def _child(self, kill: Kill) -> Child:
        name = f"worker {kill.name}" if kill.kind == "worker" else kill.name
        return next(c for c in self.sup.children if c.name == name)

    def _kill(self, kill: Kill) -> None:
        """SIGKILL: no goodbye, no last heartbeat, no flushed state."""
        if kill.kind == "node":
            self.cluster.node(kill.name).kill()
            return
        if kill.kind == SERVER:
            self.cluster.servers[0].kill()
            return
        proc = self._child(kill).proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)
        if kill.kind == "worker":
            self.down[kill.name] = time.time()

    async def _restart(self, kill: Kill, event: dict[str, Any]) -> None:
        """Start it again (in this, the main thread: a child's parent-death signal follows the thread
        that forked it); a service that exits during start-up is started again, as ``natsched up``
        would, and the attempts are reported."""
        if kill.kind == "node":
            self.cluster.node(kill.name).start()  # same data dir: it rejoins and catches up
            return
        if kill.kind == SERVER:
            self.cluster.servers[0].start()  # same port and data dir: JetStream recovers from it
            return
        child = self._child(kill)
        deadline = time.monotonic() + self.s.ready_timeout_s
        while time.monotonic() < deadline:
            self.sup.restart(child)
            event["start_attempts"] = event.get("start_attempts", 0) + 1
            while not child.ready.is_set() and child.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if child.ready.is_set():
                return
            if child.proc.poll() is not None:
                log.warning("%s exited with code %s while starting; starting it again", child.name,
                            child.proc.returncode)
                await asyncio.sleep(1.0)
        raise BusError(f"{child.name} not ready within {self.s.ready_timeout_s:.0f}s")

    # --- lease reclaim --------------------------------------------------------------------
    def _watch_reclaim(self, worker: str, killed_at: float, bus: Bus) -> None:
        """Watch the reservations on a killed worker until none is left (bounded)."""
        held = {rid for rid, w in self.assigned.items() if w == worker and rid not in self.producer
                and not self.final_replies.get(rid)}
        self.reclaim_watch[worker] = {}
        self._watch(worker, held, HELD_AT_KILL)
        self.reclaim_tasks[worker] = asyncio.create_task(self._poll_reclaim(worker, killed_at, bus))

    def _watch(self, worker: str, rids: set[str], origin: str) -> None:
        watch = self.reclaim_watch.setdefault(worker, {})
        for rid in rids:
            watch.setdefault(rid, origin)

    async def _stored_on(self, bus: Bus, worker: str) -> set[str]:
        """Request ids of the assignments the WORK stream still holds for ``worker`` (un-acked).

        The stream is the authority; the ``work.>`` subscription misses what was published while
        the observer reconnected after a node died.
        """
        try:
            stored = await bus.stream_messages(S.STREAM_WORK, S.work(worker))
        except Exception as exc:  # an election: the subscription's view has to do
            log.warning("could not read the WORK stream for %s: %s", worker, exc)
            return set()
        rids = set()
        for _, data in stored:
            try:
                rids.add(Assignment.decode(data).request.id)
            except MessageError:
                continue
        return rids

    async def _poll_reclaim(self, worker: str, killed_at: float, bus: Bus) -> float | None:
        """Seconds from the kill until no watched reservation is on ``worker`` (None: not in time).

        A reservation counts once it was seen held: one already gone at its first look had
        finished (only its ack was missing from the stream), or left before it could be timed.
        The WORK stream is read beside the polling, which must not wait for it.
        """
        watch = self.reclaim_watch[worker]
        stored = asyncio.create_task(self._stored_on(bus, worker))
        seen: set[str] = set()
        released: dict[str, float] = {}
        merged = False
        deadline = time.monotonic() + self.s.reclaim_timeout_s
        while (len(released) < len(watch) or worker in self.down or not stored.done()) \
                and time.monotonic() < deadline:
            if stored.done() and not merged:
                self._watch(worker, stored.result(), HELD_AT_KILL)
                merged = True
            for rid in [r for r in watch if r not in released]:
                gone = await self._released(bus, rid, worker)
                if gone and rid not in seen:
                    del watch[rid]
                elif gone:
                    released[rid] = round(time.time() - killed_at, 2)
                else:
                    seen.add(rid)
            await asyncio.sleep(0.1)
        stored.cancel()
        self.reclaim_detail[worker] = _reclaim_detail(watch, released)
        if not watch:  # it held nothing we could time: no measurement, rather than a vacuous 0
            return None
        return None if len(released) < len(watch) else max(released.values())

    @staticmethod
    async def _released(bus: Bus, rid: str, worker: str) -> bool:
        try:
            current = await bus.kv(S.BUCKET_INFLIGHT).get(S.reservation_key(rid))
        except Exception:  # a leader election: ask again on the next poll
            return False
        return current is None or orjson.loads(current[0]).get("moved_from") == worker

    async def _reclaims(self) -> dict[str, float | None]:
        out = {}
        for worker, task in self.reclaim_tasks.items():
            done, _ = await asyncio.wait([task], timeout=self.s.reclaim_timeout_s + 5)
            out[worker] = task.result() if done and not task.cancelled() else None
        return out

    # --- settling and reading back ----------------------------------------------------------
    async def _settle(self, bus: Bus) -> tuple[int | None, int]:
        """Until the aggregate is 0 with no reservation left (bounded): (used, reservations left)."""
        deadline = time.monotonic() + self.s.settle_timeout_s
        used, left = None, -1
        while time.monotonic() < deadline:
            try:
                current = await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE)
                used = 0 if current is None else Usage.from_json(current[0]).used
                left = sum(1 for k in await bus.kv(S.BUCKET_INFLIGHT).keys() if k.startswith("res."))
            except Exception as exc:  # keep trying within the bound
                log.info("settle: %s", exc)
            if used == 0 and left == 0:
                break
            await asyncio.sleep(0.5)
        return used, left

    async def _completions(self, bus: Bus) -> dict[str, list[tuple[str, str | None]]]:
        """Each request's completion records, as the admitters count them: one its own worker's
        attempt published (:mod:`natsched.wire.fence`); forged ones (the ``hostile`` scenario's)
        are stored too, counted apart in ``forged_completions_stored``, and are no run."""
        ours = set(self.ids)
        out: dict[str, list[tuple[str, str | None]]] = defaultdict(list)
        for subject, data in await bus.stream_messages(S.STREAM_COMPLETIONS):
            try:
                c = Completion.decode(data)
            except MessageError:
                continue
            if not fence.fenced(bus.fence_key, c, subject):
                self.forged_stored += 1
            elif c.request_id in ours:
                out[c.request_id].append((c.status, c.reason))
        return dict(out)

    async def _abandon(self) -> None:
        """Clients that leave mid-stream and while waiting, beside the load (natsched.bench.abandon)."""
        from natsched.bench.abandon import AbandonSettings, run_child

        s = self.s
        settings = AbandonSettings(streams=s.disconnects, waiting=s.disconnects, seed=s.seed,
                                   spread_s=s.send_s * 0.8)
        try:
            # their own process, as producers are: here they would wait behind the observer's work
            timeout = settings.spread_s + settings.settle_timeout_s + s.finish_timeout_s + 120
            self.abandon_report = await run_child(self.cluster.url, settings, timeout)
        except Exception as exc:  # reported as a missed target, never hidden
            log.exception("the disconnecting clients failed")
            self.abandon_report = {"error": f"{type(exc).__name__}: {exc}",
                                   "targets": {"abandoned_tokens_beyond_one_step": False}}

    def _phase(self, name: str) -> None:
        self.phases[name] = round(time.monotonic() - self.t0, 1)

    def _report(self, facts: Facts, leftover: int) -> dict[str, Any]:
        s = self.s
        report = compute_report(facts)
        if s.disconnects:
            abandon = self.abandon_report or {"targets": {"abandoned_unaccounted": False}}
            report["disconnects"] = abandon
            report["targets_met"].update(abandon["targets"])
        for name, actor in self.actor_reports.items():
            report["targets_met"].update(actor.get("targets", {}))
        report["targets_met"]["all"] = all(v for k, v in report["targets_met"].items() if k != "all")
        report.update({
            "scenario": self.scenario.name, "sync": s.sync, "actors": self.actor_reports,
            "leftover_reservations": leftover, "forged_completions_stored": self.forged_stored,
            "routed_to_dead_worker": dict(self.routed_to_dead), "reclaim_detail": self.reclaim_detail,
            "kills": self.events, "phases_s": self.phases,
            "readmitted_detail": {r: self.readmit_detail[r] for r in sorted(self.readmit_detail)[:20]},
            "seed": s.seed, "rate": s.rate, "heartbeat_s": s.heartbeat_s, "down_s": s.down_s,
            **_e2e(self.e2e),
            "system": {"nodes": s.nodes, "admitters": s.admitters, "routers": s.routers,
                       "inline_routing": s.inline_routing, "workers": s.workers,
                       "engine": "sim", "time_scale": s.time_scale, "max_tokens": s.max_tokens},
        })
        return report


def _reclaim_detail(watch: dict[str, str], released: dict[str, float]) -> dict[str, Any]:
    """Per origin: how many reservations, the slowest release, how many never released."""
    out = {}
    for origin in (HELD_AT_KILL, ROUTED_WHILE_DOWN):
        rids = [r for r, o in watch.items() if o == origin]
        times = [released[r] for r in rids if r in released]
        out[origin] = {"count": len(rids), "max_s": max(times, default=None), "never": len(rids) - len(times)}
    return out


def _e2e(values: list[float]) -> dict[str, float | None]:
    """Producer-side latency of completed requests: a kill shows up as a tail (redeliveries wait ack_wait)."""
    def pick(q: float) -> float | None:
        found = nearest_rank(values, q)
        return None if found is None else round(found, 3)

    return {"e2e_p50_s": pick(0.5), "e2e_p99_s": pick(0.99), "e2e_max_s": pick(1.0)}
