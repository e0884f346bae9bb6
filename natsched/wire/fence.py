"""Fencing tokens: which worker an attempt of a request was assigned to, in a form no worker can forge.

Why: every worker may publish completions, and a completion releases a reservation. Without a
fence, any worker (or a paused one whose request was rescued and runs elsewhere now) frees any
tenant's reservation while the real request keeps running, takes its ``<id>:done`` dedup slot,
and rewrites its audit. Permissions alone cannot say "this request was assigned to w2": a
permission names subjects, not requests.

The router (or an admitter routing inline) signs each assignment: ``fence`` = HMAC-SHA256 over
(request id, worker, attempt) with a key only the scheduler's services hold (``natsched auth
init`` writes it into their credentials). The worker copies it into its completion, which it
publishes on its own ``done.<tenant>.<worker>`` subject (a per-worker permission), with the
token in the message id (``<id>:done:<fence>``): another worker knows neither the token nor,
therefore, the message id, so it can take no slot of the real completion's. The admitter accepts
a completion only if the token verifies for the subject's worker and the attempt is the
reservation's current one (a rescue moves it on: the old worker's token is then stale).

Without ``auth init`` every connection may publish anything, and the key is a public default:
the fence then still stops stale attempts and confused workers, not a hostile one.

Pure module: no I/O.
"""

from __future__ import annotations

import hashlib
import hmac

from natsched.wire import subjects as S

#: the key when none was configured (no auth: nothing is secret on such a bus anyway)
DEFAULT_KEY = "natsched-unauthenticated-fence"
#: hex digits of the token kept: 64 bits, unguessable within any dedup window
TOKEN_HEX = 16


def sign(key: str | None, request_id: str, worker: str, attempt: int) -> str:
    """The token of ``request_id``'s ``attempt`` on ``worker``."""
    message = f"{request_id}\x00{worker}\x00{attempt}".encode()
    return hmac.new((key or DEFAULT_KEY).encode(), message, hashlib.sha256).hexdigest()[:TOKEN_HEX]


def verify(key: str | None, token: str | None, request_id: str, worker: str | None, attempt: int) -> bool:
    """Whether ``token`` is the one :func:`sign` gives for this request, worker and attempt."""
    if not token or not worker or not token.isascii():  # compare_digest raises on non-ASCII text
        return False
    return hmac.compare_digest(token, sign(key, request_id, worker, attempt))


#: why a completion is refused (the admitter's metric label)
WRONG_SOURCE = "wrong_source"  # the subject's worker is not the one the body names
BAD_FENCE = "bad_fence"  # the token is not the assignment's for that worker and attempt
STALE = "stale"  # an attempt since rescued (found against the reservation, not here)


def problem(key: str | None, completion, subject: str) -> str | None:
    """Why ``completion`` (a :class:`natsched.wire.schema.Completion` stored on ``subject``) was not
    published by the worker its request's attempt was assigned to, or None when it was."""
    source = S.completion_source(subject)
    if source is None or source != completion.worker:
        return WRONG_SOURCE
    if not verify(key, completion.fence, completion.request_id, source, completion.attempt):
        return BAD_FENCE
    return None


def fenced(key: str | None, completion, subject: str) -> bool:
    """Whether ``completion`` passes :func:`problem`."""
    return problem(key, completion, subject) is None
