"""``CleanupGroup``: the one owner of a worker's engine-side tasks.

Everything a worker does at the engine after, or beside, its callers (the
cleanup of a request whose caller has gone, the reader of a request that
its caller's task cannot read itself, a decode request's prefill leg) runs
as a task of this group, so that each one has an owner that outlives the
callers and dies before the engine.

The shape is hypercorn's trio worker: the tasks live in one nursery, inside
one cancel scope that owns them. That scope is shielded, so a caller that
cancels the worker's body (its own deadline, a crash beside it) does not cut
a cleanup short; only ``close`` ends them, by setting the grace as that
scope's deadline. The nursery itself is what knows which tasks still run:
there are no counters beside it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVarTuple

import trio

from .._errors import EngineShutdown

__all__ = ["CleanupGroup", "open_cleanup_group"]

Args = TypeVarTuple("Args")


class CleanupGroup:
    """Detached, owned engine-side tasks; see ``open_cleanup_group``."""

    def __init__(self) -> None:
        self._scope = trio.CancelScope(shield=True)
        self._nursery: trio.Nursery | None = None
        self._closing = trio.Event()
        self._idle: trio.Event | None = None

    @property
    def cutting(self) -> bool:
        """Whether the deadline given to ``close`` has passed: what still runs is being cut."""
        return self._scope.cancel_called

    @property
    def pending(self) -> int:
        """Tasks still running."""
        return 0 if self._nursery is None else len(self._nursery.child_tasks)

    def start_soon(self, work: Callable[[*Args], Awaitable[object]], *args: *Args) -> None:
        """Run ``work(*args)`` as a task of the group; ``EngineShutdown`` once it is closed.

        After ``close`` it still takes tasks until the last one has ended
        (they share the same deadline), so that a cleanup handed over during
        the grace, or an abort of a child first seen then, still runs.
        """
        assert self._nursery is not None  # set before ``open_cleanup_group`` yields
        try:
            self._nursery.start_soon(self._run, work, *args)
        except RuntimeError:  # "Nursery is closed to new arrivals": every task has ended
            raise EngineShutdown("the worker has shut down") from None

    async def wait_idle(self) -> None:
        """Return once no task is running (at once if none is)."""
        if self.pending:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()
        else:
            await trio.lowlevel.checkpoint()

    def close(self, deadline: float) -> None:
        """Cancel the tasks still running at ``deadline`` (trio clock); idempotent.

        The group closes for good once no task is left.
        """
        self._scope.deadline = min(self._scope.deadline, deadline)
        self._closing.set()

    async def _run(self, work: Callable[[*Args], Awaitable[object]], *args: *Args) -> None:
        try:
            await work(*args)
        finally:
            # This task is still among the nursery's children here.
            if self._idle is not None and self.pending == 1:
                self._idle.set()
                self._idle = None

    async def _host(self, *, task_status: trio.TaskStatus[None]) -> None:
        with self._scope:
            async with trio.open_nursery() as self._nursery:
                task_status.started()
                await self._closing.wait()


@asynccontextmanager
async def open_cleanup_group() -> AsyncIterator[CleanupGroup]:
    """A ``CleanupGroup`` for the life of the block.

    Leaving the block waits for the group's tasks, up to the deadline given
    to ``close`` (at once if ``close`` was not called); call ``close`` first
    to give them a grace. Opened after the engine and closed before it.
    """
    group = CleanupGroup()
    async with trio.open_nursery() as host:
        await host.start(group._host)
        try:
            yield group
        finally:
            if not group._closing.is_set():
                group.close(trio.current_time())
