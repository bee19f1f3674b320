"""``LogThrottle``: lines of one kind at most so often, the rest counted into the next.

A fault that a client can cause at will (a request that makes the engine
raise, a connection that trips hypercorn) must not let that client fill the
log: one line per event is a line per request, and each may carry a
traceback. Every event is still counted in the metrics; the log gets the
first few of a kind in each interval, and the next line after it says how
many were left out.
"""

from __future__ import annotations

import math

import trio

__all__ = ["LogThrottle"]


class LogThrottle:
    """Per kind: ``lines`` in each ``interval`` seconds, from the first of that kind."""

    __slots__ = ("_interval", "_kinds", "_lines")

    def __init__(self, lines: int = 10, interval: float = 10.0) -> None:
        self._lines = lines
        self._interval = interval
        #: kind -> [the interval's end, lines logged in it, events left out since the last line]
        self._kinds: dict[str, list[float]] = {}

    def take(self, kind: str) -> int | None:
        """``None``: leave this one out; else log it, with how many were left out before it."""
        now = trio.current_time()
        window = self._kinds.setdefault(kind, [-math.inf, 0, 0])
        if now >= window[0]:
            window[0], window[1] = now + self._interval, 0
        if window[1] >= self._lines:
            window[2] += 1
            return None
        window[1] += 1
        left_out, window[2] = int(window[2]), 0
        return left_out
