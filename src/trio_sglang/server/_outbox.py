"""``Outbox``: what a streaming response has produced and its client has not yet taken.

The engine does not wait for a slow client, so the server cannot read the
engine at the client's pace: the response's outputs are read as they come
and held here until its sender takes them, a child's backlog merged into
one output as SGLang itself merges one (``IncrementQueue``). A client that
falls behind gets fewer, larger events when it catches up, and what is held
grows by a few bytes per token. ``behind`` says when the held tokens pass
the response's bound: the client is then treated as gone.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import trio

from .._increments import IncrementQueue

__all__ = ["ROUND", "Audible", "Heartbeats", "Outbox"]

#: The heartbeat task's rounds are at least this far apart, so that beats due
#: within one share its wake-up (which costs about what a beat does): a beat may
#: go out up to this late. Also the most of the budget spent back to back.
ROUND = 0.01


class Audible(Protocol):
    """A streaming response the heartbeat keeps audible: an ``Outbox``, or a hosted route's."""

    #: When it last sent something (trio's clock).
    last_active: float

    def beat(self) -> None:
        """It has been silent for the spacing: send a sign of life."""
        ...


class Outbox:
    """Outputs held for one streaming response; one reader puts, one sender takes."""

    def __init__(self, max_tokens: int) -> None:
        self._max_tokens = max_tokens
        self._held = IncrementQueue()
        self._closed = False
        #: What ended the reading early, for the sender to raise once it has sent the rest.
        self.error: Exception | None = None
        #: Where the sender waits for something to take (one lot for the response's life).
        self._wakeup = trio.lowlevel.ParkingLot()
        #: When the sender last took something to send: the response is silent since.
        self.last_active = trio.current_time()
        self._beat_due = False

    @property
    def behind(self) -> bool:
        """Whether more tokens are held than the bound allows."""
        return self._held.tokens > self._max_tokens

    def put(self, out: dict[str, Any]) -> None:
        self._held.put(out)
        self._wake()

    def close(self, error: Exception | None = None) -> None:
        """No more outputs (``error``: the reading failed)."""
        self._closed = True
        self.error = error
        self._wake()

    async def take(self) -> list[dict[str, Any]] | None:
        """Everything held, in order, once there is something; ``[]`` once closed and taken.

        ``None`` when the heartbeat found the response silent: time for a sign of life.
        """
        while not self._held and not self._closed and not self._beat_due:
            await self._wakeup.park()
        self.last_active = trio.current_time()
        self._beat_due = False  # whatever goes out now is the sign of life
        if not self._held and not self._closed:
            return None
        return self._held.take_all()

    def beat(self) -> None:
        """Wake the sender for a sign of life: the heartbeat found the response silent."""
        self._beat_due = True
        self._wake()

    def _wake(self) -> None:
        self._wakeup.unpark_all()


class Heartbeats:
    """One task that keeps every silent streaming response audible, within a budget of beats.

    Each watched outbox has one entry in a heap of deadlines: the moment it
    will have been silent for the spacing. The task sleeps until the earliest
    one (in rounds at least ``ROUND`` apart), and there an outbox that sent
    since is due again a spacing after its last send, and a silent one is
    woken for a beat. Nothing is done per token but one clock read, and
    nothing per stream that is not due.

    The spacing is ``interval`` until the open streams, all silent, would beat
    more than ``max_per_second`` times a second; past that it grows with them
    (``streams / max_per_second``), and the task never beats faster than that
    however the deadlines bunch. A beat costs a wake-up and a write through
    the HTTP stack (tens of microseconds), so thousands of silent streams cost
    a bounded share of a core instead of all of it. The price: behind a proxy
    that notices a gone client only when it writes, a silent stream's client
    is noticed within the spacing, which past that many streams is longer
    than ``interval``.
    """

    def __init__(self, interval: float, max_per_second: int) -> None:
        self._interval = interval
        self._max_per_second = max_per_second
        self._watched: set[Audible] = set()
        #: ``(due, order, outbox)``: order breaks ties, first watched first.
        self._due: list[tuple[float, int, Audible]] = []
        self._order = itertools.count()
        #: Where the task waits for the next deadline; woken for an earlier one.
        self._changed = trio.lowlevel.ParkingLot()
        self._waking_at = math.inf

    @property
    def spacing(self) -> float:
        """How long a response may be silent before it beats, with this many streams open."""
        return max(self._interval, len(self._watched) / self._max_per_second)

    @contextmanager
    def watching(self, outbox: Audible) -> Iterator[None]:
        if not self._interval:
            yield
            return
        self._watched.add(outbox)
        due = outbox.last_active + self.spacing
        heapq.heappush(self._due, (due, next(self._order), outbox))
        if due < self._waking_at:
            self._changed.unpark_all()
        try:
            yield
        finally:
            self._watched.discard(outbox)  # its entry is dropped when it comes due

    async def run(self) -> None:
        """Beat until cancelled (for as long as the server takes requests)."""
        if not self._interval:
            return
        rate = self._max_per_second
        allowance, last = 1.0, trio.current_time()
        burst = rate * ROUND + 1  # what a round spends, and the fraction carried over
        while True:
            self._waking_at = max(self._due[0][0], last + ROUND) if self._due else math.inf
            if allowance < 1:  # out of beats: none before the budget has one again
                self._waking_at = max(self._waking_at, last + (1 - allowance) / rate)
            with trio.move_on_at(self._waking_at):
                await self._changed.park()
            now = trio.current_time()
            allowance = min(allowance + (now - last) * rate, burst)
            last = now
            allowance = self._beat_the_silent(now, allowance)

    def _beat_the_silent(self, now: float, allowance: float) -> float:
        """Go through the entries due by ``now``; what is left of ``allowance`` after the beats."""
        spacing = self.spacing
        while self._due and self._due[0][0] <= now:
            outbox = self._due[0][2]
            if outbox not in self._watched:
                heapq.heappop(self._due)
            elif outbox.last_active + spacing > now:  # it sent since: due again from then
                heapq.heapreplace(
                    self._due, (outbox.last_active + spacing, next(self._order), outbox)
                )
            elif allowance < 1:  # the rest wait for the budget
                break
            else:
                allowance -= 1
                outbox.beat()
                heapq.heapreplace(self._due, (now + spacing, next(self._order), outbox))
        return allowance
