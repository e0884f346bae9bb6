"""Issue 7's "done when", short enough for CI.

The services run (admitter, router, two sim workers, an offline runner) with a tight online budget
(3000 runtime tokens, batch work always degraded); a 60-line batch file is submitted as class
batch while online requests arrive at the same time. Every line completes through the offline
path, none twice; the online requests are admitted at once (never queued behind the batch); the
offline runner never reserves beyond its low watermark; the audit of any id tells its whole story;
the replay of the window under round_robin prints the comparison.
"""

import asyncio
import time
from collections import Counter

import orjson

from natsched.wire import subjects as S
from natsched.audit.records import audit_request, audit_window
from natsched.client.batch import BatchClient, JobStore
from natsched.client.producer import make_request
from natsched.wire.schema import Completion, Decision
from natsched.sim.replay import format_report, load_recording, replay
from tests.client.test_batch_submit import cli
from tests.admitter.test_offline_runner import jobs_stack, records, wait_for

LINES = 60


def batch_lines(n: int = LINES) -> bytes:
    """Requests of 2 x 96 + 16 = 208 runtime tokens, sharing a 64-token prefix in groups of 4."""
    rows = [{"prompt_token_ids": [7] * 64 + [i // 4] * 32, "max_tokens": 16} for i in range(n)]
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


async def test_batch_completes_offline_while_online_is_admitted_normally(bus, nats_url, tmp_path):
    stack, runner = await jobs_stack(nats_url, total=3000)
    try:
        since = time.time() - 1.0
        client = BatchClient(bus)
        online = [make_request("web", prompt_token_ids=list(range(40)), max_tokens=8) for _ in range(12)]
        report, *results = await asyncio.gather(client.submit(batch_lines(), "t1"),
                                                *(stack.client.submit(r) for r in online))
        assert report.published == LINES and not report.malformed
        assert await wait_for(lambda: _done(client, report.batch), timeout=120)
        await wait_for(lambda: stack.admitter.shared.usage.used == 0)

        # every line has a result, through the offline path, none twice
        rows = await client.results(report.batch)
        assert [r["status"] for r in rows] == ["completed"] * LINES
        assert all(r["output"].split() == [f"tok{i}" for i in range(16)] and r["attempts"] == 1 for r in rows)
        batch_ids = {r["id"] for r in rows}
        done = Counter(c.request_id for c in await records(bus, S.STREAM_COMPLETIONS, Completion) if c.tenant == "t1")
        assert set(done) == batch_ids and set(done.values()) == {1}
        decisions = await records(bus, S.STREAM_DECISIONS, Decision)
        by_stage = Counter((d.stage, d.decision) for d in decisions if d.request_id in batch_ids)
        assert by_stage == {("admission", "degrade"): LINES, ("offline", "allow"): LINES, ("routing", "assign"): LINES}

        # each OFFLINE message was delivered once: nothing waited for an ack timeout to be redelivered
        info = await bus.stream(S.STREAM_OFFLINE).consumer(S.CONSUMER_OFFLINE)
        assert info.delivered_consumer_seq == info.delivered_stream_seq == LINES

        # the offline runner stayed under its share: every reservation fit the low watermark
        for d in decisions:
            if d.stage == "offline":
                assert d.budget["used"] + d.runtime_tokens <= d.budget["offline_budget"] == 1500

        # online requests were admitted at once, never queued behind the batch
        assert all(r.status == "completed" and sorted(r.statuses) == ["admitted", "assigned"] for r in results)
        web = [d for d in decisions if d.tenant == "web" and d.stage == "admission"]
        assert [(d.decision, d.queue_wait) for d in web] == [("allow", None)] * len(online)

        # any id's whole story
        some = rows[17]["id"]
        story = await audit_request(bus, some, job=(await JobStore(bus).find(some))[1])
        stages = [e["stage"] for e in story["events"]]
        assert stages == ["submitted", "admission", "offline", "routing", "completion"]
        routing = story["events"][3]
        assert set(routing["scores"]) == {"w1", "w2"} and routing["worker"] == story["worker"]
        assert story["events"][1]["what"] == "degrade" and story["outcome"] == "completed"
        assert story["cached_tokens"] is not None and story["ttft"] is not None
        shown = cli(nats_url, "audit", some)
        assert shown.returncode == 0 and "offline" in shown.stdout and "scores w1=" in shown.stdout

        summary = await audit_window(bus, since, None, "t1")
        assert summary["requests"] == LINES and summary["completed"] == LINES
        assert summary["decisions"]["admission.degrade"] == {"watermark": LINES}
        assert summary["hit_ratio"] > 0  # lines share a prefix: some of it came from cache

        # the replay of the window under round_robin
        recording = await load_recording(bus, since)
        comparison = replay(recording, "round_robin", time_scale=0.05)
        assert set(comparison.columns) == {"recorded", "replay least_loaded", "replay round_robin"}
        assert comparison.columns["recorded"]["requests"] == LINES + len(online)
        assert all(c["completed"] == LINES + len(online) for c in comparison.columns.values())
        table = format_report(comparison)
        assert "replay round_robin" in table and "hit_ratio" in table
        out = tmp_path / "replay.json"
        printed = cli(nats_url, "replay", "--since", str(since), "--policy", "round_robin", "--time-scale", "0.05",
                      "--json", str(out))
        assert printed.returncode == 0 and "replay round_robin" in printed.stdout
        assert orjson.loads(out.read_bytes())["policy"] == "round_robin"
    finally:
        await stack.close()


async def _done(client: BatchClient, batch: str) -> bool:
    return (await client.status(batch)).done
