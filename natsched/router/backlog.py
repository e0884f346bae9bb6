"""Seconds of prefill queued on a worker: the router's estimate of how long a new request waits.

Why seconds and not tokens: a worker runs prefill first-come first-served in chunks, so a new
request's time to first token is (prefill queued ahead of it) + (its own uncached prefill), and
the queue must be counted in *time*. Tokens are not time: with attention, a token at 60k tokens of
context costs ~3x one at the start of a prompt, so a heartbeat's ``queued_prefill_tokens`` alone
underestimates the wait behind a long prompt by up to that much. The router knows more than the
token count: the prompts it assigned, with what it expected cached. Pure, no I/O.

The estimate is a *busy-until* time per worker (:attr:`natsched.router.policy.WorkerView.busy_until`):

- at a heartbeat: now + :func:`queued_prefill_s` of the queued tokens it reports, attributed to our
  in-flight assignments newest first (FIFO: the newest have not started; the oldest one still
  prefilling is part-way through its prompt, so its remaining tokens sit at a long context);
  then every assignment made since (not yet in a heartbeat) is appended with :func:`advance`;
- at each assignment: :func:`advance` by its own prefill time.

Between heartbeats the worker works through its queue one second per second, so ``busy_until -
now`` is the wait, without the staleness of the last report.
"""

from __future__ import annotations

from typing import Iterable

from natsched.router.costmodel import CostModel


def queued_prefill_s(queued_tokens: float, inflight: Iterable[tuple[int, int]], cost: CostModel) -> float:
    """Seconds to prefill ``queued_tokens`` on a worker running ``inflight`` requests.

    ``inflight``: (prompt tokens, uncached tokens we expected) of our requests on the worker,
    *newest first*. Queued tokens are attributed to them in that order, each taking at most its
    uncached part, at the context where that part starts; what is left over (another router's
    requests, or cache we expected that was not there) is costed as one prompt of its own.
    """
    left = float(queued_tokens)
    if left <= 0.0:
        return 0.0
    seconds = 0.0
    for prompt, uncached in inflight:
        if uncached <= 0:
            continue
        take = uncached if uncached < left else left
        seconds += cost.prefill_ctx_s(take, prompt - take)
        left -= take
        if left <= 0.0:
            return seconds
    return seconds + cost.prefill_ctx_s(left)


def advance(busy_until: float, start: float, seconds: float) -> float:
    """The worker's new busy-until once work of ``seconds`` arriving at ``start`` is queued."""
    return (busy_until if busy_until > start else start) + seconds
