"""The admitter service: decode -> AdmitterCore.decide -> publish. All I/O lives here."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import orjson

from bus import subjects as S
from bus.connection import Bus, ConsumerSpec, Delivery
from bus.schema import Admitted, Completion, Decision, Reply, Request
from admitter.policy import ALLOW, REJECT, AdmissionDecision, AdmissionSettings, AdmitterCore

log = logging.getLogger(__name__)


@dataclass
class AdmitterServiceSettings:
    name: str = "admitter"
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    ack_wait_s: float = 30.0


class AdmitterService:
    def __init__(self, bus: Bus, settings: AdmitterServiceSettings | None = None) -> None:
        self.bus = bus
        self.settings = settings or AdmitterServiceSettings()
        self.core = AdmitterCore(self.settings.admission)

    async def start(self) -> None:
        await self.bus.provision()
        current = await self.bus.kv_get(S.BUCKET_QUOTAS, S.KEY_CLUSTER_TOTAL)
        if current is not None:
            self._apply_total(current[0])
        self.bus.spawn(self._watch_quotas(), "quota-watch")
        await self.bus.consume(
            ConsumerSpec(S.STREAM_COMPLETIONS, S.CONSUMER_ADMITTER_COMPLETIONS, S.COMPLETIONS_ALL, deliver_new=True),
            self._on_completion, source="admitter",
        )
        await self.bus.consume(
            ConsumerSpec(S.STREAM_REQUESTS, S.CONSUMER_ADMITTER, S.REQUESTS_ALL, ack_wait_s=self.settings.ack_wait_s),
            self._on_request, source="admitter",
        )
        log.info("admitter ready (total %d runtime tokens)", self.core.total)

    def _apply_total(self, raw: bytes) -> None:
        try:
            total = int(orjson.loads(raw))
        except (orjson.JSONDecodeError, TypeError, ValueError):
            log.error("ignoring corrupted %s value %r; keeping total %d", S.KEY_CLUSTER_TOTAL, raw[:64], self.core.total)
            return
        self.core.set_total(total)
        log.info("cluster total set to %d runtime tokens", total)

    async def _watch_quotas(self) -> None:
        async for key, value, _rev in self.bus.kv_watch(S.BUCKET_QUOTAS, S.KEY_CLUSTER_TOTAL):
            if value is not None:
                self._apply_total(value)

    async def _on_request(self, d: Delivery) -> None:
        request = Request.decode(d.data)  # MessageError -> reply + dead letter + term (Bus)
        started = time.perf_counter()
        decision = self.core.decide(request, time.time(), d.subject)
        latency_ms = (time.perf_counter() - started) * 1000
        if decision.decision == ALLOW:
            admitted = Admitted(request=request, runtime_tokens=decision.runtime_tokens, admitted_at=time.time(),
                                admitter=self.settings.name)
            await self.bus.jpublish(S.admitted(request.cls, request.tenant), admitted, msg_id=f"{request.id}:adm")
        await self._record(request, decision, latency_ms)
        await self._tell_producer(request, decision)
        await d.ack()
        log.info("request %s %s tenant=%s class=%s tokens=%d%s", request.id, decision.decision, request.tenant,
                 request.cls, decision.runtime_tokens, f" reason={decision.reason}" if decision.reason else "")

    async def _record(self, request: Request, decision: AdmissionDecision, latency_ms: float) -> None:
        record = Decision(
            request_id=request.id, tenant=request.tenant, cls=request.cls, stage="admission",
            decision=decision.decision, ts=time.time(), reason=decision.reason, retry_after=decision.retry_after,
            runtime_tokens=decision.runtime_tokens, budget=decision.budget, by=self.settings.name,
            latency_ms=latency_ms,
        )
        await self.bus.jpublish(S.decision("admission", request.tenant), record, msg_id=f"{request.id}:admission")

    async def _tell_producer(self, request: Request, decision: AdmissionDecision) -> None:
        if not request.reply:
            return
        if decision.decision == ALLOW:
            reply = Reply(request_id=request.id, kind="status", status="admitted")
        elif decision.decision == REJECT:
            reply = Reply(request_id=request.id, kind="error", status="rejected", reason=decision.reason,
                          message=decision.message, retry_after=decision.retry_after)
        else:
            reply = Reply(request_id=request.id, kind="status", status=decision.decision)
        await self.bus.publish(request.reply, reply)

    async def _on_completion(self, d: Delivery) -> None:
        completion = Completion.decode(d.data)
        freed = self.core.release(completion.request_id)
        await d.ack()
        if freed:
            log.debug("released %d runtime tokens of %s", freed, completion.request_id)
