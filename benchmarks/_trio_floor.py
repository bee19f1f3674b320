"""Floors: what trio alone takes to cancel N parked tasks, in two shapes.

Measured beside the at-once burst and the shutdown, in the same process with
the collector on, with no lifecycle, engine or consumer (docs/benchmarks.md,
"The misses"). The shapes differ only in how the cancel reaches the tasks:
``bare_trio_burst_ms`` parks each task in a scope of its own and cancels the
scopes one at a time (10,000 callers each cancelling its own);
``bare_trio_shutdown`` parks them in one nursery under one scope cancelled
once, the shutdown's own shape (``CleanupGroup``) and the cheapest trio has:
a scope per task would make the bar lower. Its ``depth`` and ``scopes`` give
the worker's shape, reported beside the bare floor and judged by nothing.
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
    """Milliseconds from the first ``cancel()`` until the last of ``count`` tasks has exited."""
    elapsed, _ = await _cancel_parked(count, scope_each=True)
    return elapsed


async def bare_trio_shutdown(count: int, *, depth: int = 0, scopes: int = 0) -> tuple[float, float]:
    """Milliseconds from one ``cancel()`` until the last of ``count`` tasks has exited, each
    ``depth`` frames deep, ``scopes`` of them in a cancel scope each; and how many of those
    milliseconds went to collections."""
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
    """Park ``count`` tasks, wait until all are blocked, cancel them: (ms, collections' ms)."""
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
