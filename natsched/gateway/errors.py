"""Errors of the HTTP gateway. Every :class:`ApiError` becomes one OpenAI-style error object::

    {"error": {"message": "...", "type": "...", "param": "...", "code": "..."}}

never a stack trace. The tree::

    GatewayError
    ├── ConfigError            bad settings or keys file: the gateway refuses to start
    └── ApiError               an HTTP answer (status, type, code, message, param, headers)
        ├── BadRequest         400 invalid_request_error: malformed JSON, a wrong field, a bad role
        ├── Unauthorized       401 authentication_error: missing or unknown API key
        ├── Forbidden          403 permission_error: a class above the key's, /status without a status key,
        │                      a foreign Host or Origin in the open mode
        ├── NotFound           404 not_found_error: unknown model or path
        ├── MethodNotAllowed   405 invalid_request_error
        ├── Conflict           409 conflict_error: the request id was already submitted
        ├── PayloadTooLarge    413 invalid_request_error: the body is over the limit
        ├── UnsupportedMedia   415 invalid_request_error: not application/json (the open mode)
        ├── Degraded           422 natsched_degraded: moved to the offline path as a job (job_id,
        │                      Location: /v1/natsched/jobs/{id}; x-should-retry: false)
        ├── RateLimited        429 rate_limit_error with Retry-After: admission refused it for now,
        │                      or the key has its limit of calls in flight
        ├── Upstream           502 api_error: it failed on its worker
        ├── Unavailable        503 service_unavailable with Retry-After: no healthy worker
        └── GatewayTimeout     504 timeout_error: it did not finish within the client's timeout
"""

from __future__ import annotations

from natsched.errors import NatschedError

import math
from typing import Any


class GatewayError(NatschedError):
    """Root of every gateway error."""


class ConfigError(GatewayError):
    """Settings or a keys file the gateway cannot start with."""


class ApiError(GatewayError):
    status = 500
    type = "api_error"

    def __init__(self, message: str, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.extra_headers: dict[str, str] = {}

    @property
    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return dict(self.extra_headers)
        return {"retry-after": str(max(1, math.ceil(self.retry_after))), **self.extra_headers}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(ApiError):
    status, type = 400, "invalid_request_error"


class Unauthorized(ApiError):
    status, type = 401, "authentication_error"


class Forbidden(ApiError):
    status, type = 403, "permission_error"


class NotFound(ApiError):
    status, type = 404, "not_found_error"


class MethodNotAllowed(ApiError):
    status, type = 405, "invalid_request_error"


class Conflict(ApiError):
    status, type = 409, "conflict_error"


class PayloadTooLarge(ApiError):
    status, type = 413, "invalid_request_error"


class UnsupportedMedia(ApiError):
    status, type = 415, "invalid_request_error"


class Degraded(ApiError):
    """Not an error of the request: it runs later, as a job. An error status all the same, because
    OpenAI clients take any 2xx for the completion they asked for."""

    status, type = 422, "natsched_degraded"

    def __init__(self, message: str, code: str, job_id: str, location: str) -> None:
        super().__init__(message, code=code)
        self.job_id = job_id
        self.location = location

    @property
    def headers(self) -> dict[str, str]:
        return {"location": self.location, "x-should-retry": "false", "x-natsched-job-id": self.job_id}

    def body(self) -> dict[str, Any]:
        out = super().body()
        out["error"].update(job_id=self.job_id, job_url=self.location)
        return out


class RateLimited(ApiError):
    status, type = 429, "rate_limit_error"


class Upstream(ApiError):
    status, type = 502, "api_error"


class Unavailable(ApiError):
    status, type = 503, "service_unavailable"


class GatewayTimeout(ApiError):
    status, type = 504, "timeout_error"
