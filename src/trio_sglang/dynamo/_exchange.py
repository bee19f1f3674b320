"""One request's chunks, from its trio task to the runtime's asyncio generator.

Both sides run in one thread, so a chunk changes hands without a lock or a
copy: the trio task appends it and resolves the future the generator waits
on. The trio task never waits for the generator. A chunk not taken yet
takes in the next one of the same choice (``merge``, which knows the chunks'
shape: token ids or text concatenated, the later finish reason and usage
kept), as SGLang's TokenizerManager merges a backlog. So the engine is never
held back by the runtime's pace, and what waits here is bounded by the
request's own tokens.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Exchange", "Merge"]

#: Takes a chunk into the last one not taken yet, if both are of one unfinished choice; says if.
Merge = Callable[[dict[str, Any], dict[str, Any]], bool]


class Exchange:
    """Filled by ``put``/``end`` on the trio side, read by ``get()`` on the asyncio side."""

    __slots__ = ("_ended", "_error", "_loop", "_merge", "_pending", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, merge: Merge) -> None:
        self._loop = loop
        self._merge = merge
        self._pending: deque[dict[str, Any]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: BaseException | None = None

    @property
    def ended(self) -> bool:
        """True once the trio side has said its last word."""
        return self._ended

    def put(self, chunk: dict[str, Any]) -> None:
        """Hand over one chunk, merged into the last one not taken yet where ``merge`` can."""
        if not (self._pending and self._merge(self._pending[-1], chunk)):
            self._pending.append(chunk)
        self._wake()

    def end(self, error: BaseException | None = None) -> None:
        """No more chunks; ``error``, if given, is raised to the reader after the last one."""
        if not self._ended:
            self._ended = True
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> dict[str, Any] | None:
        """The next chunk, or None at the end (or its error, raised); asyncio side only.

        A coroutine, not an async generator: the handler that awaits it may be
        dropped unfinished by the runtime, from another thread, and has
        nothing of its own to finalize then.
        """
        while not self._pending:
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._waiter = self._loop.create_future()
            await self._waiter
        return self._pending.popleft()
