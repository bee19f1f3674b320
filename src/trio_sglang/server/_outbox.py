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

import math
from typing import Any

import trio

from .._increments import IncrementQueue

__all__ = ["Outbox"]


class Outbox:
    """Outputs held for one streaming response; one reader puts, one sender takes."""

    def __init__(self, max_tokens: int) -> None:
        self._max_tokens = max_tokens
        self._held = IncrementQueue()
        self._closed = False
        #: What ended the reading early, for the sender to raise once it has sent the rest.
        self.error: Exception | None = None
        self._wakeup: trio.Event | None = None

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

    async def take(self, *, idle_after: float = math.inf) -> list[dict[str, Any]] | None:
        """Everything held, in order, once there is something; ``[]`` once closed and taken.

        ``None`` if nothing came for ``idle_after`` seconds (the response is idle).
        """
        if not self._held and not self._closed:
            with trio.move_on_after(idle_after):
                while not self._held and not self._closed:
                    self._wakeup = trio.Event()
                    await self._wakeup.wait()
            if not self._held and not self._closed:
                return None
        return self._held.take_all()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None
