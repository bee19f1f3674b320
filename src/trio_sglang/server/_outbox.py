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

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

from .._increments import IncrementQueue

__all__ = ["Heartbeats", "Outbox"]


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
        #: Takes so far, and at the heartbeat's last look: equal means the sender was idle.
        self._takes = 0
        self._takes_seen = 0
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

        ``None`` when the heartbeat found the response idle: time for a sign of life.
        """
        while not self._held and not self._closed and not self._beat_due:
            await self._wakeup.park()
        self._takes += 1
        self._beat_due = False  # whatever goes out now is the sign of life
        if not self._held and not self._closed:
            return None
        return self._held.take_all()

    def look(self) -> None:
        """The heartbeat's look: idle since the last one, the sender is woken for a beat."""
        if self._takes == self._takes_seen:
            self._beat_due = True
            self._wake()
        self._takes_seen = self._takes

    def _wake(self) -> None:
        self._wakeup.unpark_all()


class Heartbeats:
    """One task that keeps every idle streaming response audible; nothing per token.

    It looks at every open outbox twice per ``interval``, and wakes the
    sender of one that sent nothing since its previous look: so a response
    is never silent for longer than ``interval``, and an idle one beats once
    per ``interval``. A response that is sending pays one counter per send.
    """

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._outboxes: set[Outbox] = set()

    @contextmanager
    def watching(self, outbox: Outbox) -> Iterator[None]:
        if not self._interval:
            yield
            return
        self._outboxes.add(outbox)
        try:
            yield
        finally:
            self._outboxes.discard(outbox)

    async def run(self) -> None:
        """Look until cancelled (for as long as the server takes requests)."""
        if not self._interval:
            return
        while True:
            await trio.sleep(self._interval / 2)
            for outbox in self._outboxes:
                outbox.look()
