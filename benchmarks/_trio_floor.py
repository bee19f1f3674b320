"""The floor under the at-once burst: what trio alone takes to cancel N parked tasks.

Cancelling 10,000 streams in one instant costs at least what trio itself
needs to cancel 10,000 parked tasks, each in its own cancel scope, one scope
at a time, and unwind them: no lifecycle, no engine, no consumer. Measured in
the same process and run as the burst it is the floor of, with the collector
left on as it is there, so the ratio between the two says how much of the
burst is this project's (and the SimEngine's) work, and how much is trio's
and the collector's.
"""

from __future__ import annotations

import trio
import trio.testing

__all__ = ["bare_trio_burst_ms"]

#: Bound on the whole measurement; a floor that takes longer says the machine is stuck.
FLOOR_BOUND = 60.0


async def bare_trio_burst_ms(count: int) -> float:
    """Milliseconds from the first ``cancel()`` until the last of ``count`` tasks has exited."""
    scopes: list[trio.CancelScope] = []
    parked = trio.lowlevel.ParkingLot()
    all_parked = trio.Event()

    async def parked_task() -> None:
        with trio.CancelScope() as scope:
            scopes.append(scope)
            if len(scopes) == count:
                all_parked.set()
            await parked.park()

    with trio.fail_after(FLOOR_BOUND):
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(parked_task)
            await all_parked.wait()
            await trio.testing.wait_all_tasks_blocked()
            started = trio.current_time()
            for scope in scopes:
                scope.cancel()
        return 1e3 * (trio.current_time() - started)
