"""``Drain``: stop taking work, wait for what is open until a grace, then cut the rest.

Every owner of open work shuts down the same way: the worker (its callers'
streams), ``serve`` (its connections) and the Dynamo bridge (its requests).
What is open is not always a nursery's children (a stream lives in its
caller's task), so a ``Drain`` keeps the open set itself, oldest first, and
wakes the shutdown when it empties. The grace is the wait's cancel scope's
deadline, as in hypercorn's trio worker, and a hurry (a second signal) is
that scope's ``cancel()``, whether the wait has begun or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

import trio

__all__ = ["Drain"]

T = TypeVar("T")


class Drain(Generic[T]):
    """The open set of one owner, and its shutdown's wait for it to empty."""

    __slots__ = ("_empty", "_open", "_waiting", "closed", "hurried")

    def __init__(self) -> None:
        self._open: dict[T, None] = {}  # oldest first
        self._empty: trio.Event | None = None
        #: The wait in progress, which ``hurry`` cancels.
        self._waiting: trio.CancelScope | None = None
        #: Set by ``close``: the owner takes no more work.
        self.closed = False
        #: Set by ``hurry``: no wait lasts from then on.
        self.hurried = False

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[T]:
        """What is open, oldest first."""
        return iter(self._open)

    def add(self, item: T) -> None:
        self._open[item] = None

    def discard(self, item: T) -> None:
        del self._open[item]
        if not self._open and self._empty is not None:
            self._empty.set()

    def close(self) -> None:
        """Take no more work: the owner reads ``closed`` before it adds any."""
        self.closed = True

    def hurry(self) -> None:
        """End the grace now, or at once when the wait begins; idempotent."""
        self.hurried = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def wait(self, deadline: float) -> bool:
        """Wait until nothing is open, at the latest until ``deadline`` (trio clock).

        True if everything closed in time. One task waits at a time.
        """
        with trio.CancelScope(deadline=deadline) as self._waiting:
            if self.hurried:
                self._waiting.cancel()
            if self._open:
                self._empty = trio.Event()
                await self._empty.wait()
        self._waiting = None
        return not self._open
