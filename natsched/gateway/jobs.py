"""``GET /v1/natsched/jobs/{id}``: what a degraded request's job looks like to an HTTP caller.

Pure: a job record in, the JSON body out. The shape is natsched's own (``object:
"natsched.job"``), never a completion's: a client that asked for a completion and got a job
must not mistake one for the other. ``usage`` uses OpenAI's names, so metering code can read it.
"""

from __future__ import annotations

from typing import Any

from natsched.wire.schema import JobRecord, JobStatus


def job_body(record: JobRecord) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": record.id, "object": "natsched.job", "status": str(record.status), "done": record.status.final,
        "created": int(record.created), "model": record.request.model if record.request else None,
        "attempts": record.attempts,
    }
    if record.status == JobStatus.COMPLETED:
        body["output"] = record.output or ""
        body["worker"] = record.worker
    if record.status == JobStatus.FAILED:
        body["error"] = {"code": record.reason or "failed", "message": record.message}
    if record.output_tokens is not None or record.prompt_tokens is not None:
        prompt, output = record.prompt_tokens or 0, record.output_tokens or 0
        body["usage"] = {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
                         "prompt_tokens_details": {"cached_tokens": record.cached_tokens or 0}}
    if record.finished is not None:
        body["finished"] = int(record.finished)
    return body
