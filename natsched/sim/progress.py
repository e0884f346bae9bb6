"""A plain-text progress line on stderr for runs that take minutes (no dependency).

On a terminal the line is redrawn in place; elsewhere (CI logs, pipes) a line is printed at most
every ``interval_s`` seconds and whenever a task finishes, so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _fmt_elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    def __init__(self, title: str, tasks: list[str], stream: TextIO | None = None, enabled: bool = True,
                 interval_s: float = 10.0) -> None:
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s if not self.tty else 0.2
        self.state: dict[str, tuple[int, int]] = {t: (0, 0) for t in tasks}
        self.finished: set[str] = set()
        self.started = time.monotonic()
        self._last = 0.0

    def update(self, task: str, done: int, total: int) -> None:
        self.state[task] = (done, total)
        if done >= total > 0:
            if task not in self.finished:
                self.finished.add(task)
                self._draw(force=True)
                return
        self._draw()

    def _line(self) -> str:
        parts = []
        for task, (done, total) in self.state.items():
            if task in self.finished:
                continue
            if total:
                parts.append(f"{task} {100 * done // total:3d}%")
        running = " | ".join(parts) if parts else "-"
        return (f"{self.title}: {len(self.finished)}/{len(self.state)} done [{_fmt_elapsed(time.monotonic() - self.started)}]"
                f"  {running}")

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        if self.tty:
            self.stream.write("\r\x1b[K" + self._line())
        else:
            self.stream.write(self._line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r\x1b[K" + self._line() + "\n")
            self.stream.flush()
