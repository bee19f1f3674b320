"""CPU spent waiting for dispatch: one poller per engine against one polling loop per request.

Described in docs/benchmarks.md, "Waiting for dispatch on SGLang": 1, 100 and
1,000 requests wait at SGLang's 0.5 ms tick on a stand-in registry (a dict of
phases, as ``rid_to_state`` is). Real time, CPU from ``time.process_time``.

    python benchmarks/dispatch_polling.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable

import trio

from trio_sglang import RequestPhase
from trio_sglang._sglang._phase_poller import PhasePoller

TICK = 0.0005
WAITERS = (1, 100, 1000)

Wait = Callable[[str, RequestPhase], Awaitable[RequestPhase]]


def registry(count: int) -> dict[str, RequestPhase]:
    return {f"r{i}": RequestPhase.REGISTERED for i in range(count)}


async def per_waiter_loop(phases: dict[str, RequestPhase], seconds: float) -> float:
    async def wait(rid: str, phase: RequestPhase) -> RequestPhase:
        while (current := phases[rid]) is phase:  # noqa: ASYNC110 (the baseline's design)
            await trio.sleep(TICK)
        return current

    return await _cpu_while_waiting(phases, wait, seconds, None)


async def one_poller(phases: dict[str, RequestPhase], seconds: float) -> float:
    poller = PhasePoller(phases.__getitem__, TICK)
    return await _cpu_while_waiting(phases, poller.wait_change, seconds, poller.run)


async def _cpu_while_waiting(
    phases: dict[str, RequestPhase],
    wait: Wait,
    seconds: float,
    service: Callable[[], Awaitable[None]] | None,
) -> float:
    """CPU seconds per second of real time while every rid waits."""
    async with trio.open_nursery() as nursery:
        if service is not None:
            nursery.start_soon(service)
        for rid in phases:
            nursery.start_soon(wait, rid, RequestPhase.REGISTERED)
        await trio.sleep(0.2)  # all parked, the first ticks done
        cpu, wall = time.process_time(), time.perf_counter()
        await trio.sleep(seconds)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        for rid in phases:
            phases[rid] = RequestPhase.DISPATCHED  # every waiter wakes and returns
        if service is not None:
            await trio.sleep(2 * TICK)
            nursery.cancel_scope.cancel()
    return cpu / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="measured per row")
    args = parser.parse_args()
    print(f"CPU while requests wait for dispatch (tick {TICK * 1e3} ms, share of one core)")
    print(f"{'waiting':>8}  {'per-waiter loop':>16}  {'one poller':>11}  {'ratio':>6}")
    for count in WAITERS:
        loop = trio.run(per_waiter_loop, registry(count), args.seconds)
        poller = trio.run(one_poller, registry(count), args.seconds)
        print(f"{count:>8,}  {loop:>15.1%}  {poller:>10.1%}  {loop / poller:>5.1f}x")


if __name__ == "__main__":
    main()
