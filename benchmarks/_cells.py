"""Run one measurement: N streams of one approach, cancelled on a schedule, on a fresh engine.

A cell is (approach, phase, concurrency); how it runs, in real time, is in
docs/benchmarks.md ("Method"). Several waves only so that small concurrencies
still give enough cancels for a p99.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio

import trio_sglang as ts
from _approaches import Approach, StreamRecord, open_approach
from _meter import Meter
from _metrics import CellResult, summarize
from _phases import AT_ONCE, MAX_NEW_TOKENS, Phase, cancel_offsets, observe_phase

__all__ = ["CellPlan", "run_at_once", "run_cell", "wait_events"]

REQUEST: dict[str, Any] = {
    "text": "How fast does a cancel reach the engine?",
    "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS},
}

#: How often the settle looks again.
SETTLE_POLL = 0.01
#: After the approach's cleanup tasks ended: how long the engine gets to let go.
ENGINE_SETTLE = 0.5
#: Bound on waiting for the engine to reach a point (every stream dispatched, say).
WAIT_BOUND = 120.0


@dataclass(frozen=True, slots=True)
class CellPlan:
    approach: str
    phase: Phase
    concurrency: int
    waves: int = 1
    seed: int = 0
    #: Requests per second at which the open streams start their lives (see ``run_cell``).
    arrival_rate: float = 1000.0
    #: Bound on waiting for the approach's detached cleanup after the last stream closed.
    settle_timeout: float = 10.0

    @property
    def spread(self) -> float:
        """Seconds over which one wave's streams start."""
        return self.concurrency / self.arrival_rate


async def run_cell(plan: CellPlan) -> CellResult:
    """Measure one cell: each wave opens all its streams, then starts each within
    ``plan.spread``, so the cancels are spread out instead of arriving as one burst behind
    the burst of opening them (the ``at_once`` scenario is that burst, on purpose)."""
    engine = plan.phase.engine()
    offsets = cancel_offsets(plan.phase, plan.concurrency * plan.waves, plan.seed)
    starts = start_delays(plan.concurrency * plan.waves, plan.spread, plan.seed)
    records = [StreamRecord(offset, start) for offset, start in zip(offsets, starts, strict=True)]
    with Meter() as meter:
        async with open_approach(plan.approach, engine) as approach:
            for first in range(0, len(records), plan.concurrency):
                wave = records[first : first + plan.concurrency]
                all_open = _Countdown(len(wave))
                async with trio.open_nursery() as nursery:
                    for rec in wave:
                        nursery.start_soon(
                            _run_stream, approach, engine, plan.phase, rec, all_open, nursery
                        )
            leaked = await _settle(approach, engine, records, plan.settle_timeout)
    return summarize(
        plan.approach,
        plan.phase.name,
        plan.concurrency,
        plan.phase.expected,
        records,
        engine.trace,
        leaked=leaked,
        meter=meter,
    )


async def run_at_once(
    approach_name: str, count: int, *, freeze_gc: bool = False, settle_timeout: float = 10.0
) -> CellResult:
    """``count`` streams parked before their first token, all cancelled in one instant.

    ``freeze_gc`` moves everything alive before the cancel out of the
    collector's reach (``gc.freeze()``, as latency-sensitive Python servers do
    after start-up), to show how much of the time is full collections over a
    large heap rather than the lifecycle's own work.
    """
    engine = AT_ONCE.engine()
    records = [StreamRecord(offset=0.0) for _ in range(count)]
    all_open = _Countdown(count)
    with Meter() as meter:
        async with open_approach(approach_name, engine) as approach:
            async with trio.open_nursery() as nursery:
                for rec in records:
                    nursery.start_soon(_run_stream, approach, engine, AT_ONCE, rec, all_open, None)
                await wait_events(engine, "dispatched", count)
                if freeze_gc:
                    gc.freeze()
                cancelled_at = trio.current_time()
                for rec in records:
                    rec.observed_phase = observe_phase(engine, rec)
                    rec.cancel_at = cancelled_at
                    rec.cancel()
                loop_ms = 1e3 * (trio.current_time() - cancelled_at)
            leaked = await _settle(approach, engine, records, settle_timeout)
    if freeze_gc:
        gc.unfreeze()
    result = summarize(
        approach_name,
        f"{AT_ONCE.name}_gc_frozen" if freeze_gc else AT_ONCE.name,
        count,
        AT_ONCE.expected,
        records,
        engine.trace,
        leaked=leaked,
        meter=meter,
    )
    result.extra["cancel_loop_ms"] = round(loop_ms, 3)
    return result


async def _run_stream(
    approach: Approach,
    engine: ts.Engine,
    phase: Phase,
    rec: StreamRecord,
    all_open: _Countdown,
    canceller: trio.Nursery | None,
) -> None:
    """One consumer: open, wait for the wave and its start, then read until cancelled.

    Without a ``canceller`` the caller cancels the stream itself.
    """
    async with approach.stream(REQUEST, rec) as chunks:
        rec.opened_at = trio.current_time()
        await all_open.arrive()
        await trio.sleep(rec.start_delay)
        rec.started_at = trio.current_time()
        if canceller is not None:
            canceller.start_soon(_cancel_at, engine, rec, rec.started_at + rec.offset)
        if phase.pull_delay:
            await trio.sleep(phase.pull_delay)
        async for _ in chunks:
            rec.chunks += 1
    rec.closed_at = trio.current_time()


async def _cancel_at(engine: ts.Engine, rec: StreamRecord, when: float) -> None:
    await trio.sleep_until(when)
    if rec.closed_at is not None:
        return  # ended on its own first: not a cancel
    rec.observed_phase = observe_phase(engine, rec)
    rec.cancel_at = trio.current_time()
    rec.cancel()


async def _settle(
    approach: Approach, engine: ts.SimEngine, records: Sequence[StreamRecord], bound: float
) -> int:
    """Let detached cleanup finish (bounded), then count the cell's rids the engine holds.

    It polls on purpose: it watches from outside, the way an operator would,
    through what the approach and the engine expose, neither of which offers
    an event for "all done".
    """
    with trio.move_on_after(bound):
        while approach.pending:  # noqa: ASYNC110 (see the docstring)
            await trio.sleep(SETTLE_POLL)
    rids = {rec.rid for rec in records}
    with trio.move_on_after(ENGINE_SETTLE):
        while not rids.isdisjoint(engine.live_rids()):  # noqa: ASYNC110
            await trio.sleep(SETTLE_POLL)
    return len(rids & engine.live_rids())


async def wait_events(engine: ts.SimEngine, kind: ts.TraceKind, count: int) -> None:
    """Wait (bounded) until the trace holds ``count`` events of ``kind``, reading it as it grows."""
    seen, found = 0, 0
    with trio.fail_after(WAIT_BOUND):
        while found < count:
            await trio.sleep(SETTLE_POLL)
            new = engine.trace[seen:]
            seen += len(new)
            found += sum(event.kind == kind for event in new)


def start_delays(count: int, spread: float, seed: int) -> list[float]:
    """When each stream starts its life after its wave is open: uniform over ``spread``."""
    rng = random.Random(f"{seed}/start/{count}")
    return [rng.uniform(0.0, spread) for _ in range(count)]


class _Countdown:
    """A barrier: ``arrive`` returns once ``count`` tasks have arrived."""

    def __init__(self, count: int) -> None:
        self._left = count
        self._done = trio.Event()
        if count <= 0:
            self._done.set()

    async def arrive(self) -> None:
        self._left -= 1
        if self._left <= 0:
            self._done.set()
        await self._done.wait()
