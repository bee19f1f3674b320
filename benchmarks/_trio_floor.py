"""Floors: what trio alone takes to cancel N parked tasks, in two shapes.

Two measurements in this project cost at least what trio itself needs to
cancel and unwind many parked tasks, so each run measures that floor beside
them, in the same process, with the collector left on as it is there: no
lifecycle, no engine, no consumer. The ratio between a measurement and its
floor says how much of it is this project's (and the SimEngine's) work, and
how much is trio's and the collector's. The two shapes differ only in how the
cancel reaches the tasks, and share the code below:

- ``bare_trio_burst_ms``, the floor under the at-once burst: 10,000 streams
  cancelled in one instant are 10,000 callers, each cancelling its own scope,
  so each bare task is parked in a cancel scope of its own and the scopes are
  cancelled one at a time, in one loop;
- ``bare_trio_shutdown``, the floor under a worker's shutdown: the shutdown
  ends its pending cleanup with one deadline on the one scope that owns their
  nursery (``CleanupGroup``), so the bare tasks are parked in one nursery
  under one scope, and that scope is cancelled once. This is the cheapest way
  trio has to end N parked tasks, and it is the shutdown's own shape: a scope
  per task would add N ``cancel()`` calls and N scope exits that the shutdown
  does not make, and so a lower bar. The cancel scopes each real cleanup task
  enters inside the group (its bounds) are that task's work, counted against
  the worker, not part of the floor. It also says how much of its time went
  to the collector (``collector_ms``), as the shutdown does: neither is
  collected by hand between its setup and its clock, so a full collection
  can land in either, and the reader should see where it did.

``bare_trio_shutdown`` also takes a shape: each task parked ``depth`` frames
deep, ``scopes`` of them inside a cancel scope of their own. The shutdown
report prints that floor at the worker's own shape beside the bare one, so
that a reader can tell trio's cost of unwinding bounded tasks from the
worker's work; the verdict stays with the bare floor.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

import trio
import trio.testing

__all__ = ["bare_trio_burst_ms", "bare_trio_shutdown", "collector_ms"]

#: Bound on the whole measurement; a floor that takes longer says the machine is stuck.
FLOOR_BOUND = 60.0


async def bare_trio_burst_ms(count: int) -> float:
    """Milliseconds from the first ``cancel()`` until the last of ``count`` tasks has exited.

    Each task is parked in a cancel scope of its own; the scopes are cancelled
    one at a time.
    """
    elapsed, _ = await _cancel_parked(count, scope_each=True)
    return elapsed


async def bare_trio_shutdown(count: int, *, depth: int = 0, scopes: int = 0) -> tuple[float, float]:
    """Milliseconds from one ``cancel()`` until the last of ``count`` tasks has exited.

    The tasks are parked in one nursery under one cancel scope, which is
    cancelled once, as a shutdown's deadline cancels a worker's pending cleanup;
    each ``depth`` frames deep, ``scopes`` of them in a cancel scope each.
    Returns those milliseconds and how many of them went to collections.
    """
    return await _cancel_parked(count, scope_each=False, depth=depth, bounds=scopes)


@contextmanager
def collector_ms() -> Iterator[list[float]]:
    """Milliseconds of each collection while the block runs, appended as they end."""
    spent: list[float] = []
    started = 0.0

    def timed(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            spent.append(1e3 * (time.perf_counter() - started))

    gc.callbacks.append(timed)
    try:
        yield spent
    finally:
        gc.callbacks.remove(timed)


async def _cancel_parked(
    count: int, *, scope_each: bool, depth: int = 0, bounds: int = 0
) -> tuple[float, float]:
    """Park ``count`` tasks, wait until all are blocked, cancel them.

    Returns the milliseconds until all have exited, and the milliseconds of
    collections among them.
    """
    scopes: list[trio.CancelScope] = []
    lot = trio.lowlevel.ParkingLot()
    all_parked = trio.Event()
    parked = 0

    async def park(frames: int = depth, within: int = bounds) -> None:
        nonlocal parked
        if frames > 0:  # one frame deeper, the outermost ones in a scope
            if within > 0:
                with trio.CancelScope(deadline=trio.current_time() + FLOOR_BOUND):
                    await park(frames - 1, within - 1)
            else:
                await park(frames - 1, 0)
            return
        parked += 1
        if parked == count:
            all_parked.set()
        await lot.park()

    async def park_in_own_scope() -> None:
        with trio.CancelScope() as scope:
            scopes.append(scope)
            await park()

    if count <= 0:
        all_parked.set()
    with trio.fail_after(FLOOR_BOUND), collector_ms() as collections:
        with trio.CancelScope() as shared:
            async with trio.open_nursery() as nursery:
                for _ in range(count):
                    nursery.start_soon(park_in_own_scope if scope_each else park)
                await all_parked.wait()
                await trio.testing.wait_all_tasks_blocked()
                collections.clear()  # the set-up's; from here on, the cancel's
                started = trio.current_time()
                if scope_each:
                    for scope in scopes:
                        scope.cancel()
                else:
                    shared.cancel()
        return 1e3 * (trio.current_time() - started), sum(collections)
