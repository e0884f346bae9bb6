"""Priority under pressure on a real nats-server: a batch backlog yields its class room to an online
burst (a loan bounded by ``lend_share``), and gets it back when the burst is over — seen in the
shared usage, the audit records, the metrics and ``natsched quota show``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from natsched.admitter.policy import AdmissionSettings
from natsched.admitter.usage import Usage
from natsched.client.producer import make_request
from natsched.wire import subjects as S
from tests.admitter.test_service import decisions, publish, set_quotas, start_admitter, stop
from tests.factories.core import make_completion
from tests.factories.core import wait_for as until

ROOT = Path(__file__).resolve().parents[2]
ON, BA = "online", "batch"


def hundred(tenant: str, cls: str):
    """A request of exactly 100 runtime tokens (2 x 33 prompt + 34 output)."""
    return make_request(tenant, prompt_token_ids=list(range(33)), cls=cls, max_tokens=34)


async def natsched_out(nats_url: str, *command: str) -> str:
    """What ``natsched COMMAND`` (default ``quota show``) prints."""
    command = command or ("quota", "show")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "natsched", *command, "--nats-url",
                                                nats_url, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


def row(text: str, name: str) -> list[str]:
    return next(line.split() for line in text.splitlines() if line.startswith(name + " "))


async def stored_usage(bus) -> Usage:
    return Usage.from_json((await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))[0])


async def complete(bus, request) -> None:
    await bus.jpublish(S.completion(request.tenant, "w1"),
                       make_completion(request.id, tenant=request.tenant, runtime_tokens=100, cls=request.cls),
                       msg_id=f"done-{request.id}")


async def test_a_batch_backlog_lends_its_room_to_an_online_burst_and_gets_it_back(bus, nats_url):
    await set_quotas(bus, cluster__total=1000, class__online__limit=400, class__batch__limit=600)
    # batch queues (not degraded) so that its backlog is visible here; nothing ages or times out
    admission = AdmissionSettings(degrade_classes=(), aging_s=3600, queue_timeout_s=3600, early_reject=False,
                                  lend_share=0.5)
    adm = await start_admitter(nats_url, admission=admission)
    try:
        batch = [hundred("b", BA) for _ in range(10)]
        for r in batch:
            await publish(bus, r)
        assert await until(lambda: adm.core.queued() == 4 and adm.shared.usage.used == 600)
        burst = [hundred("a", ON) for _ in range(8)]
        for r in burst:
            await publish(bus, r)
        assert await until(lambda: adm.core.queued() == 8 and adm.shared.usage.used == 1000)
        ds = {d.request_id: d for d in await decisions(bus) if d.decision == "allow"}
        running_batch = [r for r in batch if r.id in ds]
        running_online = [r for r in burst if r.id in ds]
        assert (len(running_batch), len(running_online)) == (6, 4)
        assert not (await stored_usage(bus)).loans  # online's own limit held its first 400

        # 400 of batch's room frees while its own backlog waits: online borrows, up to half of 600
        for r in running_batch[:4]:
            await complete(bus, r)
        assert await until(lambda: adm.shared.usage.loans == {(ON, BA): 300} and adm.core.queued() == 4)
        usage = await stored_usage(bus)
        assert usage.classes == {ON: 700, BA: 300} and usage.used == 1000
        allows = [d for d in await decisions(bus) if d.decision == "allow"]
        loaned = [d for d in allows if (d.budget or {}).get("loan")]
        assert len(loaned) == 3 and all(d.budget["loan"] == {BA: 100} and d.budget["class_limit"] == 400
                                        for d in loaned)
        newly = [d.request_id for d in allows if d.request_id not in ds]
        queued_batch = [r.id for r in batch if r not in running_batch]
        assert sum(rid in queued_batch for rid in newly) == 1  # the backlog yielded: 3 online, 1 batch
        # the reconciliation finds the records agree with the class counts, and keeps the loan
        assert await adm.reconcile_once() == 0 and await adm.reconcile_once() == 0
        assert (await stored_usage(bus)).loans == {(ON, BA): 300}
        # every step visible: the audit, quota show and the metrics
        story = await natsched_out(nats_url, "audit", loaned[0].request_id)
        assert "loan=batch:100" in story and "class_limit=400" in story and "class=online" in story, story
        shown = await natsched_out(nats_url)
        assert row(shown, ON)[:5] == [ON, "400", "700", "300", "(batch)"]
        assert row(shown, BA)[:6] == [BA, "600", "300", "0", "300", "(online)"]
        assert await until(lambda: adm.metrics.registry.get_sample_value(
            "natsched_admission_class_tokens", {"class": ON, "kind": "borrowed"}) == 300)
        assert adm.metrics.registry.get_sample_value("natsched_admission_class_tokens",
                                                     {"class": BA, "kind": "lent"}) == 300
        assert adm.metrics.registry.get_sample_value("natsched_admission_borrowed_runtime_tokens_total",
                                                     {"borrower": ON, "lender": BA}) == 300

        # the burst ends: every online request completes (those admitted meanwhile too); online
        # releases repay the loan first, and the batch backlog gets its whole limit back
        done: set[str] = set()

        async def online_finished() -> bool:
            for d in await decisions(bus):
                if d.decision == "allow" and d.cls == ON and d.request_id not in done:
                    done.add(d.request_id)
                    await complete(bus, next(r for r in burst if r.id == d.request_id))
            return len(done) == 8 and adm.core.queued() == 0 and adm.shared.usage.classes.get(ON, 0) == 0

        assert await until(online_finished)
        usage = await stored_usage(bus)
        assert usage.loans == {} and usage.classes == {BA: 600} and usage.used == 600
        assert {d.request_id for d in await decisions(bus) if d.decision == "allow"} >= {r.id for r in batch}
        shown = await natsched_out(nats_url)
        assert row(shown, ON)[:5] == [ON, "400", "0", "0", "0"] and row(shown, BA)[:5] == [BA, "600", "600", "0", "0"]
    finally:
        await stop(adm)
