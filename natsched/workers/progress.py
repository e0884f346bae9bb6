"""Decode progress between heartbeats: what the router judges a slowdown by. Pure, no I/O.

Why: a completion shows a slowed engine only when it ends, a whole decode later; every token of
every running request shows it at once (:mod:`natsched.router.progress`). The agent sees each
request's output stream, so it needs nothing from the engine: per output after a request's first
token, the tokens it carries and the time since that request's previous output. The sum of those
gaps over the tokens is the mean time per decode step its requests saw; the heartbeat carries
both (``Heartbeat.decode_tokens`` / ``decode_s``) and :meth:`DecodeProgress.take` starts anew.
"""

from __future__ import annotations


class DecodeProgress:
    """Tokens produced after each request's first since the last :meth:`take`, and their gaps."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}  # request id -> when its previous output came
        self.tokens = 0
        self.seconds = 0.0

    def output(self, rid: str, tokens: int, t: float) -> None:
        """An output of ``tokens`` tokens of request ``rid`` at ``t`` (seconds, any clock)."""
        if tokens <= 0:
            return
        last = self._last.get(rid)
        self._last[rid] = t
        if last is None:
            return  # its first token ends the prefill wait, not a decode step
        self.tokens += tokens
        self.seconds += max(t - last, 0.0)

    def close(self, rid: str) -> None:
        self._last.pop(rid, None)

    def take(self) -> tuple[int, float]:
        """(tokens, seconds) since the previous call; counting starts anew."""
        out = (self.tokens, self.seconds)
        self.tokens, self.seconds = 0, 0.0
        return out
