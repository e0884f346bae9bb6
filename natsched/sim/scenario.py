"""Scenario files: one file = a cluster, its traffic, what happens to it, the SLOs and the headline.

A scenario is data (YAML or JSON; the format is documented in ``docs/scenarios.md``). This
module reads one, checks every field and turns it into plain dataclasses; a bad file raises
:class:`~natsched.sim.errors.ScenarioError` naming the file and the dotted path of the field
(``cluster.workers[1].profile: unknown profile 'h200'; known: ...``). Unknown keys are errors
too: a typo must not silently fall back to a default. Pure apart from reading the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from natsched.sim.errors import ScenarioError
from natsched.workers.profiles import PROFILES, EngineProfile

BUILTIN_DIR = Path(__file__).resolve().parent / "scenarios"
GENERATORS = ("sessions",)
HEADLINES = {  # metric -> higher is better
    "online_goodput": True, "ttft_p99_s": False, "ttft_p50_s": False, "phase_ttft_p99_s": False,
    "hit_ratio": True,
}
CLASSES = ("online", "batch", "offline")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
PROFILE_FIELDS = {f.name for f in dataclasses.fields(EngineProfile)} - {"name", "description"}


@dataclass
class WorkerGroup:
    count: int
    profile: str
    model: str = "default"
    kv_blocks: int | None = None
    max_num_seqs: int | None = None


@dataclass
class Tenant:
    name: str
    share: float  # of arrivals
    floor: float = 0.0
    weight: float = 1.0


@dataclass
class Burst:
    at_s: float
    duration_s: float
    factor: float


@dataclass
class Traffic:
    trace: str | None = None  # Mooncake JSONL ("mooncake": the shipped one)
    target_busy: list[float] = field(default_factory=list)  # loads: calibrated under least_loaded
    limit: int | None = None  # trace: keep the first N requests
    generator: str | None = None
    duration_s: float = 300.0
    rate_rps: float | None = None  # base session-start rate (else from `load`)
    load: float | None = None  # base offered load as a share of the cluster's capacity (measured)
    tenants: list[Tenant] = field(default_factory=list)
    zipf: float | None = None  # tenant popularity exponent, when shares are not given
    classes: dict[str, float] = field(default_factory=lambda: {"online": 1.0})
    models: dict[str, float] = field(default_factory=lambda: {"default": 1.0})
    bursts: list[Burst] = field(default_factory=list)
    system_prompt_tokens: tuple[int, int] = (2000, 6000)
    kb_chunks: int = 32  # per tenant
    kb_chunk_tokens: int = 512
    kb_per_request: tuple[int, int] = (2, 4)
    kb_version_s: float = 120.0  # a tenant's knowledge base changes this often
    turns: tuple[int, int] = (1, 6)
    think_s: float = 8.0  # mean pause between a session's turns
    user_tokens: tuple[int, int] = (30, 300)
    output_tokens: tuple[int, int] = (40, 400)


@dataclass
class Event:
    at_s: float
    kind: str
    worker: str | None = None
    count: int = 1
    profile: str | None = None
    model: str = "default"
    factor: float = 1.0
    duration_s: float | None = None


@dataclass
class Scenario:
    name: str
    source: str
    description: str = ""
    seed: int = 1
    block_size: int = 64
    profiles: dict[str, EngineProfile] = field(default_factory=dict)
    workers: list[WorkerGroup] = field(default_factory=list)
    traffic: Traffic = field(default_factory=Traffic)
    events: list[Event] = field(default_factory=list)
    slo_ttft_s: dict[str, float] = field(default_factory=dict)  # per class
    headline: str = "ttft_p99_s"
    also: list[str] = field(default_factory=list)
    sweep_points: int = 3
    sweep_span: float = 0.1
    quick_scale: float = 0.4
    contenders: list[str] | None = None
    phases: list[float] = field(default_factory=list)  # boundaries (s) for phase_ttft_p99_s

    @property
    def higher_is_better(self) -> bool:
        return HEADLINES[self.headline]

    def profile(self, name: str) -> EngineProfile:
        return self.profiles.get(name) or PROFILES[name]

    @property
    def n_workers(self) -> int:
        return sum(g.count for g in self.workers)


# ------------------------------------------------------------------ reading


def load_scenario(path: str | Path) -> Scenario:
    """Read and check one scenario file (``.yaml``/``.yml`` or ``.json``)."""
    path = Path(path)
    src = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(src, "", f"cannot read: {exc.strerror or exc}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScenarioError(src, "", f"not JSON: {exc.msg} at line {exc.lineno}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ScenarioError(src, "", f"not YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    return parse_scenario(data, src)


def find_scenarios(paths: list[str | Path] | None) -> list[Path]:
    """Files named (directories: their ``*.yaml``, ``*.yml``, ``*.json``), else the built-in ones."""
    if not paths:
        paths = [BUILTIN_DIR]
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix.lower() in (".yaml", ".yml", ".json"))
            if not found:
                raise ScenarioError(str(p), "", "directory holds no .yaml, .yml or .json scenario")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise ScenarioError(str(p), "", "no such file or directory")
    return out


class _Reader:
    """Typed access to one mapping, with the dotted path for errors and a check for unknown keys."""

    def __init__(self, src: str, data: Any, path: str) -> None:
        self.src, self.path = src, path
        if not isinstance(data, dict):
            raise ScenarioError(src, path or "(top level)", f"must be a mapping, got {type(data).__name__}")
        self.data = data
        self.used: set[str] = set()

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str):
        raise ScenarioError(self.src, self.at(key), message)

    def raw(self, key: str, default: Any = ..., required: bool = False) -> Any:
        self.used.add(key)
        if key not in self.data or self.data[key] is None:
            if required:
                self.fail(key, "is required")
            return None if default is ... else default
        return self.data[key]

    def num(self, key: str, default: Any = ..., *, lo: float | None = None, hi: float | None = None,
            integer: bool = False, lo_open: bool = False, required: bool = False) -> Any:
        v = self.raw(key, default, required)
        if v is None or v is default and default is not ...:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
            self.fail(key, f"must be {'an integer' if integer else 'a number'}, got {v!r}")
        if not math.isfinite(v):
            self.fail(key, f"must be finite, got {v!r}")
        if lo is not None and (v < lo or (lo_open and v == lo)):
            self.fail(key, f"must be {'>' if lo_open else '>='} {lo:g}, got {v!r}")
        if hi is not None and v > hi:
            self.fail(key, f"must be <= {hi:g}, got {v!r}")
        return int(v) if integer else float(v)

    def text(self, key: str, default: Any = ..., required: bool = False) -> Any:
        v = self.raw(key, default, required)
        if v is not None and not isinstance(v, str):
            self.fail(key, f"must be a string, got {v!r}")
        return v

    def pair(self, key: str, default: tuple[int, int]) -> tuple[int, int]:
        v = self.raw(key, default)
        if (not isinstance(v, (list, tuple)) or len(v) != 2 or any(isinstance(x, bool) or not isinstance(x, int)
                                                                    for x in v) or not 0 <= v[0] <= v[1]):
            self.fail(key, f"must be [low, high], two integers with 0 <= low <= high, got {v!r}")
        return int(v[0]), int(v[1])

    def items(self, key: str, required: bool = False) -> list[Any]:
        v = self.raw(key, [], required)
        if not isinstance(v, list):
            self.fail(key, f"must be a list, got {type(v).__name__}")
        if required and not v:
            self.fail(key, "must not be empty")
        return v

    def child(self, key: str, required: bool = False) -> "_Reader":
        v = self.raw(key, {}, required)
        return _Reader(self.src, v, self.at(key))

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            where = self.path or "top level"
            raise ScenarioError(self.src, self.at(unknown[0]), f"unknown key (in {where}: known: "
                                f"{', '.join(sorted(self.used))})")


def _shares(r: _Reader, key: str, default: dict[str, float], allowed: tuple[str, ...] | None = None) -> dict:
    v = r.raw(key, default)
    if not isinstance(v, dict) or not v:
        r.fail(key, f"must be a mapping of name to share, got {v!r}")
    out = {}
    for name, share in v.items():
        if allowed is not None and name not in allowed:
            r.fail(f"{key}.{name}", f"unknown class; known: {', '.join(allowed)}")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or share < 0:
            r.fail(f"{key}.{name}", f"must be a share >= 0, got {share!r}")
        out[str(name)] = float(share)
    total = sum(out.values())
    if total <= 0:
        r.fail(key, "shares must not all be 0")
    return {k: s / total for k, s in out.items()}


def parse_scenario(data: Any, source: str = "<scenario>") -> Scenario:
    """Check a decoded scenario (a dict) and build the :class:`Scenario`."""
    top = _Reader(source, data, "")
    name = top.text("name", required=True)
    if not _NAME.match(name):
        top.fail("name", f"must be lower-case letters, digits, '-' or '_', got {name!r}")
    sc = Scenario(name=name, source=source, description=top.text("description", ""),
                  seed=top.num("seed", 1, integer=True, lo=0))
    _cluster(top.child("cluster", required=True), sc)
    sc.traffic = _traffic(top.child("traffic", required=True), sc)
    sc.events = [_event(_Reader(source, e, f"events[{i}]"), sc) for i, e in enumerate(top.items("events"))]
    _check_event_workers(sc)
    slo = top.child("slo")
    ttft = slo.raw("ttft_s", {})
    if not isinstance(ttft, dict):
        slo.fail("ttft_s", f"must be a mapping of class to seconds, got {ttft!r}")
    for cls, v in ttft.items():
        if cls not in CLASSES:
            slo.fail(f"ttft_s.{cls}", f"unknown class; known: {', '.join(CLASSES)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            slo.fail(f"ttft_s.{cls}", f"must be seconds > 0, got {v!r}")
        sc.slo_ttft_s[cls] = float(v)
    slo.done()
    head = top.child("headline", required=True)
    sc.headline = head.text("metric", required=True)
    if sc.headline not in HEADLINES:
        head.fail("metric", f"unknown metric {sc.headline!r}; known: {', '.join(HEADLINES)}")
    if sc.headline == "online_goodput" and "online" not in sc.slo_ttft_s:
        head.fail("metric", "online_goodput needs slo.ttft_s.online")
    sc.also = [str(x) for x in head.items("also")]
    for i, m in enumerate(sc.also):
        if m not in HEADLINES:
            head.fail(f"also[{i}]", f"unknown metric {m!r}; known: {', '.join(HEADLINES)}")
    phases = head.items("phases_s")
    for i, x in enumerate(phases):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0:
            head.fail(f"phases_s[{i}]", f"must be seconds > 0, got {x!r}")
    sc.phases = sorted(float(x) for x in phases)
    if sc.headline == "phase_ttft_p99_s" and not sc.phases:
        head.fail("phases_s", "phase_ttft_p99_s needs the phase boundaries (seconds)")
    head.done()
    sweep = top.child("sweep")
    sc.sweep_points = sweep.num("points", 3, integer=True, lo=1)
    sc.sweep_span = sweep.num("span", 0.1, lo=0.0, hi=0.5)
    sweep.done()
    quick = top.child("quick")
    sc.quick_scale = quick.num("scale", 0.4, lo=0.0, hi=1.0, lo_open=True)
    quick.done()
    contenders = top.raw("contenders", None)
    if contenders is not None:
        from natsched.sim.contenders import CONTENDERS

        if not isinstance(contenders, list) or not contenders:
            top.fail("contenders", "must be a non-empty list of contender names")
        for i, c in enumerate(contenders):
            if c not in CONTENDERS:
                top.fail(f"contenders[{i}]", f"unknown contender {c!r}; known: {', '.join(CONTENDERS)}")
        if "natsched" not in contenders:
            top.fail("contenders", "must include natsched (every verdict is natsched against the others)")
        sc.contenders = list(contenders)
    top.done()
    return sc


def _cluster(r: _Reader, sc: Scenario) -> None:
    sc.block_size = r.num("block_size", 64, integer=True, lo=1)
    profiles = r.child("profiles")
    for pname in list(profiles.data):
        pr = profiles.child(pname)
        base = pr.text("base", required=True)
        if base not in PROFILES:
            pr.fail("base", f"unknown profile {base!r}; known: {', '.join(sorted(PROFILES))}")
        changes = {}
        for key in list(pr.data):
            if key == "base":
                continue
            if key not in PROFILE_FIELDS:
                pr.fail(key, f"not a profile field; known: {', '.join(sorted(PROFILE_FIELDS))}")
            changes[key] = pr.num(key, lo=0.0, lo_open=True,
                                  integer=isinstance(getattr(PROFILES[base], key), int))
        pr.done()
        sc.profiles[pname] = dataclasses.replace(PROFILES[base], name=pname, description=f"{base} with {changes}",
                                                 **changes)
    profiles.used = set(profiles.data)
    known = sorted(set(PROFILES) | set(sc.profiles))
    for i, g in enumerate(r.items("workers", required=True)):
        gr = _Reader(sc.source, g, f"{r.at('workers')}[{i}]")
        profile = gr.text("profile", "h100-llama8b")
        if profile not in known:
            gr.fail("profile", f"unknown profile {profile!r}; known: {', '.join(known)}")
        sc.workers.append(WorkerGroup(gr.num("count", 1, integer=True, lo=1), profile, gr.text("model", "default"),
                                      gr.num("kv_blocks", None, integer=True, lo=1),
                                      gr.num("max_num_seqs", None, integer=True, lo=1)))
        gr.done()
    r.done()


def _traffic(r: _Reader, sc: Scenario) -> Traffic:
    t = Traffic()
    t.trace = r.text("trace", None)
    t.generator = r.text("generator", None)
    if (t.trace is None) == (t.generator is None):
        r.fail("trace", "give either a trace (Mooncake JSONL, or 'mooncake') or a generator, not both")
    busy = r.raw("target_busy", [])
    busy = busy if isinstance(busy, list) else [busy]
    for i, b in enumerate(busy):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < 1:
            r.fail(f"target_busy[{i}]", f"must be a busy fraction strictly between 0 and 1, got {b!r}")
    t.target_busy = [float(b) for b in busy]
    if t.trace is not None:
        t.limit = r.num("limit", None, integer=True, lo=1)
        if not t.target_busy:
            r.fail("target_busy", "a trace needs the busy fraction(s) to replay it at")
        r.done()
        return t
    if t.generator not in GENERATORS:
        r.fail("generator", f"unknown generator {t.generator!r}; known: {', '.join(GENERATORS)}")
    t.duration_s = r.num("duration_s", 300.0, lo=1.0)
    t.rate_rps = r.num("rate_rps", None, lo=0.0, lo_open=True)
    t.load = r.num("load", None, lo=0.0, lo_open=True)
    if t.target_busy:
        r.fail("target_busy", "is for traces; a generator takes load (a share of the cluster's capacity) or "
                              "rate_rps")
    if (t.rate_rps is None) == (t.load is None):
        r.fail("rate_rps", "give either rate_rps (sessions started per second) or load (share of capacity), not both")
    t.zipf = r.num("zipf", None, lo=0.0)
    for i, tr in enumerate(r.items("tenants", required=True)):
        tn = _Reader(sc.source, tr, f"{r.at('tenants')}[{i}]")
        name = tn.text("name", required=True)
        share = tn.num("share", None, lo=0.0)
        t.tenants.append(Tenant(name, -1.0 if share is None else share, tn.num("floor", 0.0, lo=0.0, hi=1.0),
                                tn.num("weight", 1.0, lo=0.0)))
        tn.done()
    names = [x.name for x in t.tenants]
    if len(set(names)) != len(names):
        r.fail("tenants", f"tenant names must be unique, got {names}")
    if sum(x.floor for x in t.tenants) > 1.0 + 1e-9:
        r.fail("tenants", "floors sum to more than 1")
    given = [x.share >= 0 for x in t.tenants]
    if any(given) and not all(given):
        r.fail("tenants", "give every tenant a share, or none (then zipf sets them)")
    if not any(given):
        s = 1.0 if t.zipf is None else t.zipf
        for k, x in enumerate(t.tenants):
            x.share = 1.0 / (k + 1) ** s
    total = sum(x.share for x in t.tenants)
    if total <= 0:
        r.fail("tenants", "shares must not all be 0")
    for x in t.tenants:
        x.share /= total
    t.classes = _shares(r, "classes", {"online": 1.0}, CLASSES)
    t.models = _shares(r, "models", {"default": 1.0})
    served = {g.model for g in sc.workers}
    for m in t.models:
        if m not in served:
            r.fail(f"models.{m}", f"no worker serves model {m!r}; served: {', '.join(sorted(served))}")
    for i, b in enumerate(r.items("bursts")):
        br = _Reader(sc.source, b, f"{r.at('bursts')}[{i}]")
        t.bursts.append(Burst(br.num("at_s", required=True, lo=0.0), br.num("duration_s", required=True, lo=0.0,
                                                                             lo_open=True),
                              br.num("factor", required=True, lo=0.0, lo_open=True)))
        br.done()
    t.system_prompt_tokens = r.pair("system_prompt_tokens", t.system_prompt_tokens)
    t.kb_chunks = r.num("kb_chunks", t.kb_chunks, integer=True, lo=0)
    t.kb_chunk_tokens = r.num("kb_chunk_tokens", t.kb_chunk_tokens, integer=True, lo=1)
    t.kb_per_request = r.pair("kb_per_request", t.kb_per_request)
    if t.kb_per_request[1] > t.kb_chunks:
        r.fail("kb_per_request", f"asks for up to {t.kb_per_request[1]} chunks of a {t.kb_chunks}-chunk base")
    t.kb_version_s = r.num("kb_version_s", t.kb_version_s, lo=0.0, lo_open=True)
    t.turns = r.pair("turns", t.turns)
    if t.turns[0] < 1:
        r.fail("turns", "a session has at least one turn")
    t.think_s = r.num("think_s", t.think_s, lo=0.0)
    t.user_tokens = r.pair("user_tokens", t.user_tokens)
    t.output_tokens = r.pair("output_tokens", t.output_tokens)
    if t.output_tokens[0] < 1:
        r.fail("output_tokens", "every request generates at least one token")
    r.done()
    return t


def worker_id(i: int, total: int) -> str:
    """The simulator's id of the ``i``-th worker of ``total`` (initial and added): ``w`` and the
    index zero-padded to the width of the largest (``w03`` of 16), as ``sim/des.py`` names them."""
    return f"w{i:0{len(str(max(1, total) - 1))}d}"


def _check_event_workers(sc: Scenario) -> None:
    """Every kill/slow names a worker alive at that moment, in the simulator's time order (by
    ``at_s``, file order on ties, as its event heap runs them): checked here, so a wrong id fails
    when the file is read and not minutes into a run. ``w3`` and ``w03`` name the same worker; the
    event keeps the simulator's spelling."""
    total = sc.n_workers + sum(e.count for e in sc.events if e.kind == "add")
    alive, added = set(range(sc.n_workers)), sc.n_workers
    for i, ev in sorted(enumerate(sc.events), key=lambda p: (p[1].at_s, p[0])):
        if ev.kind == "add":
            alive |= set(range(added, added + ev.count))
            added += ev.count
            continue
        n = int(ev.worker[1:])
        where = f"events[{i}].worker"
        if n >= total:
            raise ScenarioError(sc.source, where, f"no worker {ev.worker!r}: the cluster has {sc.n_workers}"
                                f" and events add {total - sc.n_workers} (ids {worker_id(0, total)}.."
                                f"{worker_id(total - 1, total)})")
        if n >= added:
            raise ScenarioError(sc.source, where, f"{ev.kind} at {ev.at_s:g}s: worker {ev.worker!r} "
                                f"({worker_id(n, total)}) is not added yet at that time")
        if n not in alive:
            raise ScenarioError(sc.source, where, f"{ev.kind} at {ev.at_s:g}s: worker {ev.worker!r} "
                                f"({worker_id(n, total)}) is killed by an earlier event")
        ev.worker = worker_id(n, total)
        if ev.kind == "kill":
            alive.discard(n)


def _event(r: _Reader, sc: Scenario) -> Event:
    kind = r.text("kind", required=True)
    if kind not in ("add", "kill", "slow"):
        r.fail("kind", f"must be add, kill or slow, got {kind!r}")
    at = r.num("at_s", required=True, lo=0.0)
    ev = Event(at, kind)
    if kind == "add":
        ev.count = r.num("count", 1, integer=True, lo=1)
        ev.profile = r.text("profile", sc.workers[0].profile if sc.workers else "h100-llama8b")
        known = set(PROFILES) | set(sc.profiles)
        if ev.profile not in known:
            r.fail("profile", f"unknown profile {ev.profile!r}; known: {', '.join(sorted(known))}")
        ev.model = r.text("model", "default")
    else:
        ev.worker = r.text("worker", required=True)
        if not re.match(r"^w\d+$", ev.worker):
            r.fail("worker", f"must be a worker id like w0, got {ev.worker!r}")
        if kind == "slow":
            ev.factor = r.num("factor", required=True, lo=0.0, hi=1.0, lo_open=True)
            ev.duration_s = r.num("duration_s", None, lo=0.0, lo_open=True)
    r.done()
    return ev
