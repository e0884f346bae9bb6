"""The admission decision: pure and synchronous (state in, decision out).

The unit is the *runtime token* (ARCHITECTURE.md): a request costs the prompt tokens it will
prefill plus the KV it will hold (prompt + expected output), so a 10-token chat and a
50k-token document are not the same load. This module decides; ``admitter.service`` does I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from bus import subjects as S
from bus.blocks import estimate_prompt_tokens
from bus.schema import Request, RequestId, TenantId

log = logging.getLogger(__name__)

ALLOW, QUEUE, REJECT, DEGRADE = "allow", "queue", "reject", "degrade"


@dataclass
class AdmissionSettings:
    max_prompt_tokens: int = 131_072  # longer prompts are rejected as invalid before any quota
    max_output_tokens: int = 32_768
    default_total: int = 400_000  # cluster runtime-token total until the quotas bucket says otherwise
    retry_after_s: float = 1.0  # the hint given with quota rejections
    classes: tuple[str, ...] = S.CLASSES


@dataclass
class AdmissionDecision:
    decision: str
    runtime_tokens: int
    reason: str | None = None
    message: str | None = None
    retry_after: float | None = None
    budget: dict = field(default_factory=dict)


def runtime_tokens(request: Request) -> int:
    """Prefill still owed (the whole prompt: the admitter cannot know the cache) + KV held."""
    prompt = estimate_prompt_tokens(request)
    output = request.expected_output_tokens or request.max_tokens
    return prompt + prompt + max(0, output)


def validate(request: Request, settings: AdmissionSettings, subject_class: str | None = None,
             subject_tenant: str | None = None) -> tuple[str, str] | None:
    """(reason, message) when the request is unusable, before any quota is taken."""
    if request.cls not in settings.classes:
        return "invalid_class", f"unknown class {request.cls!r}; known: {', '.join(settings.classes)}"
    if subject_class is not None and (subject_class, subject_tenant) != (request.cls, request.tenant):
        return "subject_mismatch", (f"published on class {subject_class!r} tenant {subject_tenant!r} but the body "
                                    f"says {request.cls!r} / {request.tenant!r}")
    if request.max_tokens <= 0:
        return "invalid_max_tokens", f"max_tokens must be > 0, got {request.max_tokens}"
    if request.max_tokens > settings.max_output_tokens:
        return "invalid_max_tokens", f"max_tokens {request.max_tokens} exceeds the limit {settings.max_output_tokens}"
    if request.expected_output_tokens is not None and request.expected_output_tokens < 0:
        return "invalid", "expected_output_tokens must be >= 0"
    prompt = estimate_prompt_tokens(request)
    if prompt > settings.max_prompt_tokens:
        return "prompt_too_long", f"prompt of ~{prompt} tokens exceeds the limit {settings.max_prompt_tokens}"
    if request.prompt_token_ids is not None and any(t < 0 for t in request.prompt_token_ids):
        return "invalid", "prompt_token_ids must be non-negative"
    return None


class AdmitterCore:
    """Tracks in-flight reservations against the cluster total and decides allow / reject."""

    def __init__(self, settings: AdmissionSettings | None = None) -> None:
        self.settings = settings or AdmissionSettings()
        self.total = self.settings.default_total
        self.inflight: dict[RequestId, tuple[TenantId, int]] = {}
        self.used = 0

    def set_total(self, total: int) -> None:
        self.total = max(0, int(total))

    def budget(self) -> dict:
        return {"in_flight": self.used, "total": self.total, "requests": len(self.inflight)}

    def decide(self, request: Request, now: float, subject: str | None = None) -> AdmissionDecision:
        parsed = S.parse_request_subject(subject) if subject else None
        problem = validate(request, self.settings, *(parsed or (None, None)))
        if problem:
            reason, message = problem
            return AdmissionDecision(REJECT, 0, reason, message, budget=self.budget())
        cost = runtime_tokens(request)
        if request.id in self.inflight:  # redelivered after a crash before ack: same reservation
            return AdmissionDecision(ALLOW, self.inflight[request.id][1], budget=self.budget())
        if cost > self.total:
            return AdmissionDecision(REJECT, cost, "too_large",
                                     f"needs {cost} runtime tokens, the cluster total is {self.total}",
                                     budget=self.budget())
        if self.used + cost > self.total:
            return AdmissionDecision(REJECT, cost, "quota_exhausted",
                                     f"{self.used}+{cost} runtime tokens would exceed the total {self.total}",
                                     retry_after=self.settings.retry_after_s, budget=self.budget())
        self.inflight[request.id] = (request.tenant, cost)
        self.used += cost
        return AdmissionDecision(ALLOW, cost, budget=self.budget())

    def release(self, request_id: RequestId) -> int:
        """Free a reservation (idempotent: a duplicate completion frees nothing)."""
        entry = self.inflight.pop(request_id, None)
        if entry is None:
            return 0
        self.used -= entry[1]
        return entry[1]
