"""``natsched batch | jobs | audit | replay | offline | retention``: parsers and commands.

``add_parsers(subparsers)`` adds them to the top-level parser, each bound to its handler (exit
code 0, 1 for an error printed as one ``natsched: error:`` line, 2 for "not found" where a
script may want to tell it apart). ``python -m natsched.cli.jobs ...`` runs them alone.
Settings dataclasses are built here, once, from the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from natsched.cli.argtypes import positive_float, positive_int
from natsched.cli.options import connect, fail, no_server
from natsched.cli.options import url_flag as _url

COMMANDS = ("batch", "jobs", "audit", "replay", "offline", "retention")
NOT_FOUND = 2


def parse_time(text: str, now: float | None = None) -> float:
    """``now``, an age (``90s``, ``15m``, ``2h``, ``7d``, also ``-15m`` or ``15m ago``), unix seconds,
    or ISO 8601 (``2025-05-01T12:00:00``, local time unless it names a zone) -> unix seconds."""
    from natsched.bus.provision import parse_duration

    now = time.time() if now is None else now
    raw = text.strip().lower().removesuffix(" ago").lstrip("-").strip()
    if raw == "now":
        return now
    if raw and raw[-1] in "smhdw" and raw[:-1].replace(".", "", 1).isdigit():
        return now - parse_duration(raw)
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"time {text!r}: use now, an age like 15m / 2h / 7d, unix seconds or "
                                         f"ISO 8601 like 2025-05-01T12:00:00") from None
    return (when if when.tzinfo else when.astimezone()).timestamp()


def _fmt_ts(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="milliseconds") if ts else "-"


# ------------------------------------------------------------------ parsers

def add_parsers(sub: argparse._SubParsersAction) -> None:
    for add, command in ((_batch_parser, _batch), (_jobs_parser, _jobs), (_audit_parser, _audit),
                         (_replay_parser, _replay), (_offline_parser, _offline), (_retention_parser, _retention)):
        for parser in add(sub):
            parser.set_defaults(handler=functools.partial(run, command))


def _batch_parser(sub) -> None:
    b = sub.add_parser("batch", help="submit a JSONL batch once; follow it; fetch its results",
                       description="Batch producer: one request per JSON line, submitted once however often run.")
    bs = b.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = bs.add_parser("submit", help="publish every line of FILE.jsonl (the batch id is the last word printed)")
    _url(s)
    s.add_argument("file", type=Path, metavar="FILE.jsonl")
    s.add_argument("--tenant", required=True)
    s.add_argument("--class", dest="cls", default="batch", choices=["batch", "offline", "online"],
                   help="request class (default batch: runs now if there is room, else on the offline path)")
    s.add_argument("--rate", type=positive_float, default=None, help="at most R requests per second")
    s.add_argument("--resume", action="store_true",
                   help="continue an interrupted submission (refused if this file was never submitted)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    st = bs.add_parser("status", help="counts of a batch's requests by state")
    _url(st)
    st.add_argument("batch_id")
    st.add_argument("--json", action="store_true")
    r = bs.add_parser("results", help="one JSON line per request: id, status, output or error")
    _url(r)
    r.add_argument("batch_id")
    r.add_argument("--out", type=Path, required=True, metavar="FILE.jsonl", help="where to write (- for stdout)")
    return s, st, r


def _jobs_parser(sub) -> None:
    j = sub.add_parser("jobs", help="batch and offline jobs: show one, list many",
                       description="Job records persisted by the offline runner (bucket jobs, kept 30 days).")
    js = j.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = js.add_parser("show", help="one job by id")
    _url(show)
    show.add_argument("job_id")
    show.add_argument("--tenant", default=None, help="the job's tenant (needed with a batch-<tenant> credential, "
                                                     "which may read its own tenant's jobs only)")
    show.add_argument("--json", action="store_true")
    ls = js.add_parser("list", help="jobs of a tenant, optionally of some states")
    _url(ls)
    ls.add_argument("--tenant", default=None)
    ls.add_argument("--batch", default=None, help="only this batch's jobs")
    ls.add_argument("--status", default=None, help="comma-separated: submitted, waiting, running, completed, failed")
    ls.add_argument("--limit", type=positive_int, default=100, help="at most N rows (default 100)")
    ls.add_argument("--json", action="store_true")
    return show, ls


def _audit_parser(sub) -> None:
    a = sub.add_parser("audit", help="one request's whole story, or a window in numbers",
                       description="Rebuild a request's timeline (or summarise a window) from REQUESTS, DECISIONS "
                                   "and COMPLETIONS.")
    _url(a)
    a.add_argument("request_id", nargs="?", help="the request (or job) id; omit with --since for a window")
    a.add_argument("--tenant", default=None, help="only this tenant's records (window mode)")
    a.add_argument("--since", type=parse_time, default=None, help="window start: now, 15m, 2h, 7d, unix s, ISO")
    a.add_argument("--until", type=parse_time, default=None, help="window end (default: now)")
    a.add_argument("--by-policy", action="store_true",
                   help="window mode: the requests by routing policy (live vs canary), each against the baseline "
                        "with the difference and its standard error")
    a.add_argument("--baseline", default=None, metavar="POLICY",
                   help="with --by-policy: compare against this policy (default: the live one of the routing config)")
    a.add_argument("--json", action="store_true")
    return (a,)


def _replay_parser(sub) -> None:
    r = sub.add_parser("replay", help="replay a recorded window under another routing policy (simulated)",
                       description="Run a window's recorded requests through the simulator under the live policy "
                                   "and under --policy; print recorded vs replayed side by side.")
    _url(r)
    r.add_argument("--since", type=parse_time, required=True)
    r.add_argument("--until", type=parse_time, default=None)
    r.add_argument("--policy", required=True, help="routing policy to try (natsched bench routing lists them)")
    r.add_argument("--tenant", default=None)
    r.add_argument("--workers", type=positive_int, default=None, help="simulated workers (default: as recorded)")
    r.add_argument("--profile", default=None, help="engine profile (default h100-llama8b)")
    r.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="the live sim workers' --time-scale (default 1)")
    r.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the comparison as JSON")
    return (r,)


def _offline_parser(sub) -> None:
    o = sub.add_parser("offline", help="run one offline runner replica",
                       description="Run degraded and offline work on idle capacity; keep every job's outcome.")
    _url(o)
    o.add_argument("--name", default="offline", help="replica name in audit records")
    o.add_argument("--low-watermark", type=float, default=0.5,
                   help="take work while usage stays within this share of the admission total (default 0.5)")
    o.add_argument("--max-attempts", type=positive_int, default=3, help="runs per job before it fails (3)")
    o.add_argument("--job-timeout", type=positive_float, default=600.0,
                   help="seconds an attempt may stay silent before it counts as failed (600)")
    o.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    o.add_argument("--partitions", type=positive_int, default=None,
                   help="partitioned admission: admit each job through its tenant's partition, within that "
                        "partition's budget (default: as many as REQUESTS stores requests in; docs/fleet.md)")
    return (o,)


def _retention_parser(sub) -> None:
    r = sub.add_parser("retention", help="show or set how long streams keep data, and how much",
                       description="Stream limits (max age, max bytes); set values are stored in the config "
                                   "bucket (key retention) and applied at once.")
    rs = r.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = rs.add_parser("show", help="every stream's limits and what it holds")
    _url(show)
    show.add_argument("--json", action="store_true")
    st = rs.add_parser("set", help="change one stream's (or the jobs bucket's) limits")
    _url(st)
    st.add_argument("stream", help="REQUESTS, DECISIONS, COMPLETIONS, OFFLINE, OUTCOMES, ..., or jobs")
    st.add_argument("--max-age", default=None, help="e.g. 14d, 12h")
    st.add_argument("--max-bytes", default=None, help="e.g. 4GiB, 512MiB")
    return show, st


# ------------------------------------------------------------------ running

def run(command, args: argparse.Namespace) -> int:
    """Run ``command(args)``: the offline runner on the services' loop, a client command on asyncio's."""
    from natsched.bus.errors import NoServerError
    from natsched.errors import NatschedError
    from natsched.hosting.runtime import run_loop

    try:
        runner = run_loop if command is _offline else asyncio.run  # the service on uvloop, like the others
        return runner(command(args)) or 0
    except NotFoundExit as exc:
        return fail(str(exc), NOT_FOUND)
    except NoServerError as exc:
        return fail(no_server(exc.url))
    except BrokenPipeError:
        raise  # the reader left: natsched.cli.app exits quietly
    except (NatschedError, ValueError, OSError) as exc:
        return fail(str(exc))


class NotFoundExit(Exception):
    """An id the store does not know: exit code 2."""


def _print_json(value: Any) -> None:
    print(orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode())


async def _connect(args):
    return await connect(args, f"natsched-{args.command}")


# --- batch ------------------------------------------------------------------------------------

class Bar:
    """A progress bar on stderr: redrawn in place on a terminal, every 10 % elsewhere."""

    def __init__(self, title: str, stream=None) -> None:
        self.title, self.stream = title, stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started, self.last_tenth = time.monotonic(), -1

    def __call__(self, done: int, total: int) -> None:
        tenth = 10 * done // total if total else 10
        if not self.tty and tenth == self.last_tenth:
            return
        self.last_tenth = tenth
        width = 30
        filled = width * done // total if total else width
        rate = done / max(1e-9, time.monotonic() - self.started)
        line = f"{self.title} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} ({rate:.0f}/s)"
        self.stream.write(("\r\x1b[K" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


async def _batch(args) -> int:
    from natsched.client.batch import BatchClient
    from natsched.client.errors import NotFound

    bus = await _connect(args)
    try:
        client = BatchClient(bus)
        if args.action == "submit":
            return await _batch_submit(client, args)
        try:
            if args.action == "status":
                return await _batch_status(client, args)
            return await _batch_results(client, args)
        except NotFound as exc:
            raise NotFoundExit(str(exc)) from None
    finally:
        await bus.close()


async def _batch_submit(client, args) -> int:
    bar = Bar(f"batch {args.file.name}")
    try:
        report = await client.submit_file(args.file, args.tenant, args.cls, rate=args.rate, resume=args.resume,
                                          progress=None if args.json else bar)
    finally:
        bar.close()
    for line, why in sorted(report.malformed.items()):
        print(f"natsched: {args.file}:{line}: skipped: {why}", file=sys.stderr)
    if args.json:
        _print_json({"batch": report.batch, "lines": report.lines, "requests": report.requests,
                     "malformed": report.malformed, "published": report.published, "already": report.already})
        return 0
    print(f"{report.published} of {report.requests} requests published now, {report.already} already there, "
          f"{len(report.malformed)} malformed line(s) skipped; batch {report.batch}")
    return 0


async def _batch_status(client, args) -> int:
    status = await client.status(args.batch_id)
    m = status.manifest
    if args.json:
        _print_json({"batch": m.id, "tenant": m.tenant, "class": m.cls, "source": m.source, "lines": m.lines,
                     "requests": status.requests, "malformed": len(m.malformed), "submitted": m.submitted,
                     "complete": m.complete, "counts": status.counts, "done": status.done})
        return 0
    counts = ", ".join(f"{k} {v}" for k, v in status.counts.items()) or "nothing yet"
    state = "done" if status.done else ("submitting" if not m.complete else "in progress")
    print(f"batch {m.id} ({m.source or '-'}, tenant {m.tenant}, class {m.cls}): {status.requests} requests, "
          f"{len(m.malformed)} malformed line(s); {state}: {counts}")
    return 0


async def _batch_results(client, args) -> int:
    rows = await client.results(args.batch_id)
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    if str(args.out) == "-":
        sys.stdout.write(data.decode())
    else:
        args.out.write_bytes(data)
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        print(f"wrote {len(rows)} results to {args.out}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


# --- jobs -------------------------------------------------------------------------------------

async def _jobs(args) -> int:
    from natsched.wire import subjects as S
    from natsched.client.batch import JOB_STATUSES, JobStore

    bus = await _connect(args)
    try:
        store = JobStore(bus)
        if args.action == "show":
            found = await store.find(args.job_id, args.tenant or "*")
            if found is None:
                raise NotFoundExit(f"job {args.job_id} not found (no record in bucket {S.BUCKET_JOBS}; records are "
                                   f"kept 30 days after their last change)")
            return _show_job(found[1], args.json)
        wanted = set(args.status.split(",")) if args.status else None
        unknown = (wanted or set()) - set(JOB_STATUSES)
        if unknown:
            raise ValueError(f"unknown status {', '.join(sorted(unknown))}; known: {', '.join(JOB_STATUSES)}")
        found = await store.scan(S.job_filter(args.tenant or "*", args.batch or "*"))
        records = sorted((r for _, r in found if wanted is None or r.status in wanted), key=lambda r: r.updated)
        return _list_jobs(records[-args.limit:], len(records), args.json)
    finally:
        await bus.close()


def _job_json(record) -> dict:
    out = record.to_wire()
    out.pop("request", None)
    if record.request is not None:
        out["request"] = {k: v for k, v in record.request.to_wire().items() if k != "prompt_token_ids"}
    return out


def _show_job(record, as_json: bool) -> int:
    if as_json:
        _print_json(_job_json(record))
        return 0
    print(f"job {record.id} (tenant {record.tenant}, batch {record.batch}"
          + (f", line {record.line}" if record.line else "") + f"): {record.status}")
    print(f"  attempts {record.attempts} (current id {record.attempt_id or '-'}), path {record.path or '-'}, "
          f"worker {record.worker or '-'}")
    if record.reason:
        print(f"  reason {record.reason}" + (f": {record.message}" if record.message else ""))
    if record.status == "completed":
        print(f"  {record.prompt_tokens} prompt tokens ({record.cached_tokens} cached), {record.output_tokens} output,"
              f" TTFT {record.ttft if record.ttft is None else round(record.ttft, 4)}s")
        print(f"  output: {(record.output or '')[:500]}")
    for h in record.history:
        extra = " ".join(f"{k}={v}" for k, v in h.items() if k not in ("ts", "event"))
        print(f"  {_fmt_ts(h.get('ts'))}  {h.get('event')}  {extra}")
    return 0


def _list_jobs(records: list, matched: int, as_json: bool) -> int:
    if as_json:
        _print_json([_job_json(r) for r in records])
        return 0
    print(f"{'job':<34}{'status':<11}{'att':>4}  {'worker':<8}{'updated':<31}reason")
    for r in records:
        print(f"{r.id:<34}{r.status:<11}{r.attempts:>4}  {r.worker or '-':<8}{_fmt_ts(r.updated):<31}{r.reason or ''}")
    print(f"{len(records)} of {matched} matching job(s)")
    return 0


# --- audit ------------------------------------------------------------------------------------

async def _audit(args) -> int:
    from natsched.audit.records import AuditNotFound, audit_by_policy, audit_request, audit_window
    from natsched.client.batch import JobStore

    if args.request_id is None and args.since is None:
        raise ValueError("give a request id, or a window with --since TIME [--until TIME] [--tenant T]")
    if (args.by_policy or args.baseline) and (args.request_id is not None or args.since is None):
        raise ValueError("--by-policy/--baseline compare a window: give --since TIME (and no request id)")
    if args.baseline and not args.by_policy:
        raise ValueError("--baseline needs --by-policy")
    bus = await _connect(args)
    try:
        if args.by_policy:
            report = await audit_by_policy(bus, args.since, args.until, args.tenant, args.baseline)
            if args.json:
                _print_json(report)
            else:
                from natsched.audit.compare import format_table
                from natsched.audit.records import when

                print(format_table(report, when))
            return 0
        if args.request_id is None:
            summary = await audit_window(bus, args.since, args.until, args.tenant)
            _print_json(summary) if args.json else _print_summary(summary)
            return 0
        found = await JobStore(bus).find(args.request_id)
        try:
            story = await audit_request(bus, args.request_id, args.since, args.until,
                                        found[1] if found else None)
        except AuditNotFound as exc:
            raise NotFoundExit(str(exc)) from None
        _print_json(story) if args.json else _print_story(story)
        return 0
    finally:
        await bus.close()


def _print_story(story: dict) -> None:
    print(f"request {story['id']} (tenant {story['tenant']}, class {story['class'] or '-'}): {story['outcome']}")
    for e in story["events"]:
        print(f"  {_fmt_ts(e['ts'])}  {e['stage']:<10} {e['what']:<8} {_event_detail(e)}")
    bits = [f"worker {story['worker'] or '-'}", f"cached tokens {story['cached_tokens']}",
            f"TTFT {_secs(story['ttft'])}", f"queue wait {_secs(story['queue_wait'])}"]
    print("  " + ", ".join(bits))
    if "job" in story:
        j = story["job"]
        print(f"  job: {j['status']} after {j['attempts']} attempt(s), path {j['path'] or '-'}, batch {j['batch']}"
              + (f", reason {j['reason']}" if j["reason"] else ""))


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def _event_detail(e: dict) -> str:
    skip = {"ts", "stage", "what", "scores", "budget", "request_id"}
    parts = [f"{k}={_short(v)}" for k, v in e.items() if k not in skip]
    if e.get("request_id"):
        parts.insert(0, f"as {e['request_id']}")
    if e.get("budget"):
        parts.append("budget " + " ".join(f"{k}={_short(v)}" for k, v in e["budget"].items()))
    if e.get("scores"):
        parts.append("scores " + " ".join(f"{w}={_score(s)}" for w, s in sorted(e["scores"].items())))
    return " ".join(parts)


def _score(score: Any) -> str:
    """A candidate's score: a number, or the router's terms (the total, and its cache view)."""
    if not isinstance(score, dict):
        return _short(score)
    total = score.get("score")
    cached = score.get("cached_tokens")
    return (_short(total) if total is not None else "?") + (f"(cached {cached})" if cached else "")


def _short(v: Any) -> str:
    """A value in one word: a float without noise, a mapping as ``k:v,k:v`` (a loan ``batch:100``)."""
    if isinstance(v, dict):
        return ",".join(f"{k}:{_short(x)}" for k, x in v.items()) or "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _print_summary(s: dict) -> None:
    window = f"{_fmt_ts(s['since'])} .. {_fmt_ts(s['until']) if s['until'] else 'now'}"
    print(f"window {window}, tenant {s['tenant'] or 'all'}: {s['requests']} requests, {s['completed']} completed")
    if s.get("note"):
        print(f"  note: {s['note']}")
    for key, reasons in s["decisions"].items():
        print(f"  {key:<22} " + ", ".join(f"{r} {n}" for r, n in reasons.items()))
    if s["failed"]:
        print("  failed after admission: " + ", ".join(f"{r} {n}" for r, n in s["failed"].items()))
    hit = "-" if s["hit_ratio"] is None else f"{s['hit_ratio']:.1%}"
    print(f"  TTFT p50 {_secs(s['ttft_p50_s'])} p99 {_secs(s['ttft_p99_s'])}; queue wait p50 "
          f"{_secs(s['queue_wait_p50_s'])} p99 {_secs(s['queue_wait_p99_s'])}; offline wait p50 "
          f"{_secs(s['offline_wait_p50_s'])} p99 {_secs(s['offline_wait_p99_s'])}; hit ratio {hit}")
    if s["workers"]:
        print("  completed per worker: " + ", ".join(f"{w} {n}" for w, n in s["workers"].items()))


# --- replay -----------------------------------------------------------------------------------

async def _replay(args) -> int:
    from natsched.sim.replay import format_report, load_recording, replay
    from natsched.workers.profiles import DEFAULT_PROFILE

    bus = await _connect(args)
    try:
        recording = await load_recording(bus, args.since, args.until, args.tenant)
    finally:
        await bus.close()
    if not recording.routed:
        print(f"nothing to replay: {recording.submitted} request(s) recorded in the window, none routed")
        return 0
    report = replay(recording, args.policy, args.workers, args.profile or DEFAULT_PROFILE, args.time_scale)
    print(format_report(report))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2))
        print(f"wrote {args.json}")
    return 0


# --- offline runner, retention ----------------------------------------------------------------

async def _offline(args) -> int:
    from natsched.admitter.offline import OfflineRunner, OfflineSettings
    from natsched.hosting.runtime import serve

    settings = OfflineSettings(name=args.name, low_watermark=args.low_watermark, max_attempts=args.max_attempts,
                               job_timeout_s=args.job_timeout, metrics_port=args.metrics_port,
                               partitions=args.partitions)

    async def start(bus):
        runner = OfflineRunner(bus, settings)
        await runner.start()
        return f"low_watermark={settings.low_watermark} total={runner.total} partitions={runner.partitions}"

    await serve(args.nats_url, "offline", start, credentials=args.credentials)
    return 0


async def _retention(args) -> int:
    bus = await _connect(args)
    try:
        await bus.provision(jobs=True)
        if args.action == "show":
            return await _retention_show(bus, args.json)
        return await _retention_set(bus, args)
    finally:
        await bus.close()


def _stream_of(target: str) -> str:
    from natsched.wire import subjects as S

    return f"KV_{S.BUCKET_JOBS}" if target == S.BUCKET_JOBS else target


async def _retention_show(bus, as_json: bool) -> int:
    from natsched.bus.provision import default_limits, retention_targets

    overrides = await bus.stored_overrides()
    rows = []
    for target in retention_targets():
        kept = await bus.stream(_stream_of(target)).retention()
        default = default_limits(target)
        rows.append({"stream": target, "max_age_s": kept.max_age_s, "max_bytes": kept.max_bytes,
                     "messages": kept.messages, "oldest": kept.first_ts, "set": target in overrides,
                     "default_max_age_s": default.max_age_s, "default_max_bytes": default.max_bytes})
    if as_json:
        _print_json(rows)
        return 0
    print(f"{'stream':<13}{'max age':>10}{'max bytes':>12}{'messages':>10}  oldest")
    for r in rows:
        kept = retention_text(r["max_age_s"], r["max_bytes"])
        print(f"{r['stream']:<13}{kept[0]:>10}{kept[1]:>12}{r['messages']:>10}  {_fmt_ts(r['oldest'])}"
              + ("  (set by natsched retention set)" if r["set"] else ""))
    return 0


def retention_text(max_age_s: float, max_bytes: int) -> tuple[str, str]:
    from natsched.cli.fmt import fmt_age, fmt_size

    return fmt_age(max_age_s), fmt_size(max_bytes)


async def _retention_set(bus, args) -> int:
    from natsched.wire import subjects as S
    from natsched.bus.provision import StreamLimits, default_limits, parse_duration, parse_size, retention_targets

    target = args.stream if args.stream in retention_targets() else args.stream.upper()
    if target not in retention_targets():
        raise ValueError(f"unknown stream {args.stream!r}; known: {', '.join(retention_targets())}")
    if args.max_age is None and args.max_bytes is None:
        raise ValueError("give --max-age and/or --max-bytes")
    old = (await bus.stored_overrides()).get(target, default_limits(target))
    new = StreamLimits(parse_duration(args.max_age) if args.max_age else old.max_age_s,
                       parse_size(args.max_bytes) if args.max_bytes else old.max_bytes)
    await bus.set_retention({target: new})
    was, now = retention_text(old.max_age_s, old.max_bytes), retention_text(new.max_age_s, new.max_bytes)
    print(f"{target} now keeps {now[0]} / {now[1]} (was {was[0]} / {was[1]}); stored in bucket "
          f"{S.BUCKET_CONFIG} key {S.KEY_RETENTION}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from natsched.hosting.runtime import setup_logging

    parser = argparse.ArgumentParser(prog="natsched")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_parsers(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
