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


# --- fenced replies: what a producer can check itself ------------------------------------
#
# A producer holds no fence key (it would let it sign assignments), so it cannot check a
# completion's token. Each tenant is given its own *reply key* instead, derived from the fence
# key (``natsched auth init`` writes it into that tenant's producer, batch and gateway
# credentials): the router signs every assignment a second time with the tenant's reply key, the
# worker copies that ``reply_fence`` into each reply it sends, on its own sub-subject
# ``<reply>.<worker>`` (a per-worker permission: the server vouches for the sender). The
# producer takes output only from a worker whose token verifies for (request, that worker,
# attempt): another worker knows no token of this request, and another tenant's key signs
# nothing of this tenant's. The producer reads its key, never the fence key.

#: why a producer refused a worker's reply (its ``refused_replies`` counter and log line)
REPLY_WRONG_WORKER = "wrong_worker"  # the body's worker is not the sub-subject's
REPLY_BAD_FENCE = "bad_fence"  # no valid token of this request for that worker and attempt
REPLY_STALE = "stale"  # a worker the request was rerouted from, or an older attempt
REPLY_UNFENCED = "unfenced"  # output on the services' own reply subject (only services publish there)


def reply_key(key: str | None, tenant: str) -> str:
    """The reply key of ``tenant``, derived from the fence ``key`` (None: the public default)."""
    message = f"natsched-reply\x00{tenant}".encode()
    return hmac.new((key or DEFAULT_KEY).encode(), message, hashlib.sha256).hexdigest()[:32]


def reply_sign(tenant_key: str, request_id: str, worker: str, attempt: int) -> str:
    """The token ``worker`` puts in its replies to ``request_id``'s ``attempt``."""
    return sign(tenant_key, request_id, worker, attempt)


def reply_problem(tenant_key: str, reply, source: str | None, request_id: str, attempt: int,
                  abandoned: frozenset[str] | set[str] = frozenset()) -> str | None:
    """Why a producer must not take ``reply`` (a :class:`natsched.wire.schema.Reply` of its
    request ``request_id``) that came from the worker ``source`` (the sub-subject; None: the
    services' subject), or None when it may. ``attempt`` is the newest attempt it has taken
    output from, ``abandoned`` the workers it was rerouted from."""
    if source is None:  # statuses and refusals are the services'; output never comes from them
        return REPLY_UNFENCED if reply.kind in ("token", "result") else None
    if reply.worker != source:
        return REPLY_WRONG_WORKER
    if source in abandoned or (reply.attempt or 0) < attempt:
        return REPLY_STALE
    if not verify(tenant_key, reply.fence, request_id, source, reply.attempt or 0):
        return REPLY_BAD_FENCE
    return None
