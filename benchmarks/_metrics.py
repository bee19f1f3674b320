"""Turn one cell's stream records and the engine's trace into the reported metrics.

The definitions are docs/benchmarks.md's ("Method"). Everything is on the trio
clock, which the SimEngine also stamps its trace with: one time line for the
caller's side and the engine's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio_sglang as ts
from _approaches import StreamRecord
from _meter import Meter
from _stats import percentiles

__all__ = ["CellResult", "summarize"]


_END_KINDS = frozenset({"abort_applied", "released", "finished"})


@dataclass(slots=True, eq=False)
class _RidTrace:
    dispatched_at: float | None = None
    ended_at: float | None = None
    wasted: int = 0
    seen: bool = False


@dataclass(slots=True)
class CellResult:
    approach: str
    phase: str
    concurrency: int
    cancels: int
    stream_close_ms: list[float]
    abort_delay_ms: list[float]
    wasted_tokens: list[float]
    aborts_lost: int
    leaked: int
    #: Requests the engine still held at the end (their abort delay is infinite).
    unstopped: int
    #: Cancels whose observed phase was not the intended one.
    off_phase: int
    cpu_s: float
    wall_s: float
    #: Involuntary context switches during the cell (the OS ran something else).
    preempted: int = 0
    #: While cancels were served (first cancel to last close): the longest the OS
    #: held the CPU away within one event-loop batch, the most CPU one batch used,
    #: and the longest garbage collection.
    stall_max_ms: float = 0.0
    batch_max_ms: float = 0.0
    gc_max_ms: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "approach": self.approach,
            "phase": self.phase,
            "concurrency": self.concurrency,
            "cancels": self.cancels,
            "stream_close_ms": percentiles(self.stream_close_ms),
            "abort_delay_ms": percentiles(self.abort_delay_ms),
            "aborts_lost": self.aborts_lost,
            "leaked": self.leaked,
            "wasted_tokens": percentiles(self.wasted_tokens),
            "unstopped": self.unstopped,
            "off_phase": self.off_phase,
            "cpu_us_per_cancel": self.cpu_us_per_cancel,
            "wall_s": round(self.wall_s, 3),
            "loop_load": round(self.cpu_s / self.wall_s, 3) if self.wall_s else None,
            "preempted": self.preempted,
            "stall_max_ms": round(self.stall_max_ms, 2),
            "batch_max_ms": round(self.batch_max_ms, 2),
            "gc_max_ms": round(self.gc_max_ms, 2),
            **self.extra,
        }

    @property
    def cpu_us_per_cancel(self) -> float:
        return 1e6 * self.cpu_s / max(1, self.cancels)

    @property
    def all_stopped_ms(self) -> float | None:
        """When the last caller's stream had closed and the engine let go of the last request.

        None if some request was never stopped.
        """
        closed = percentiles(self.stream_close_ms)["max"]
        stopped = percentiles(self.abort_delay_ms)["max"]
        return None if closed is None or stopped is None else max(closed, stopped)


def _index_trace(
    trace: Iterable[ts.TraceEvent], records: Sequence[StreamRecord]
) -> tuple[dict[str, _RidTrace], int]:
    """One pass over the trace: per-rid dispatch, end and wasted tokens; lost aborts."""
    cancel_at = {rec.rid: rec.cancel_at for rec in records}
    by_rid = {rid: _RidTrace() for rid in cancel_at}
    lost = 0
    for event in trace:
        if event.kind == "abort_lost":
            lost += 1
        seen = by_rid.get(event.rid)
        if seen is None:
            continue
        seen.seen = True
        if event.kind == "dispatched":
            seen.dispatched_at = event.time
        elif event.kind in _END_KINDS:
            if seen.ended_at is None:
                seen.ended_at = event.time
        elif event.kind == "token":
            cancelled = cancel_at[event.rid]
            if cancelled is not None and event.time > cancelled:
                seen.wasted += 1
    return by_rid, lost


def _abort_delay(rec: StreamRecord, seen: _RidTrace) -> float:
    assert rec.cancel_at is not None
    if not seen.seen:
        return 0.0  # never registered: the engine never held it
    if seen.ended_at is None:
        return math.inf
    start = rec.cancel_at if seen.dispatched_at is None else max(rec.cancel_at, seen.dispatched_at)
    return max(0.0, seen.ended_at - start)


def summarize(
    approach: str,
    phase: str,
    concurrency: int,
    expected_phase: str,
    records: Sequence[StreamRecord],
    trace: Iterable[ts.TraceEvent],
    *,
    leaked: int,
    meter: Meter,
) -> CellResult:
    by_rid, lost = _index_trace(trace, records)
    cancelled = [rec for rec in records if rec.cancel_at is not None]
    close_ms, delay_ms, wasted = [], [], []
    for rec in cancelled:
        assert rec.cancel_at is not None
        if rec.closed_at is not None:
            close_ms.append(1e3 * (rec.closed_at - rec.cancel_at))
        seen = by_rid[rec.rid]
        delay_ms.append(1e3 * _abort_delay(rec, seen))
        wasted.append(float(seen.wasted))
    stall, batch, collection = _disturbances(meter, cancelled)
    return CellResult(
        approach=approach,
        phase=phase,
        concurrency=concurrency,
        cancels=len(cancelled),
        stream_close_ms=close_ms,
        abort_delay_ms=delay_ms,
        wasted_tokens=wasted,
        aborts_lost=lost,
        leaked=leaked,
        unstopped=sum(math.isinf(d) for d in delay_ms),
        off_phase=sum(rec.observed_phase != expected_phase for rec in cancelled),
        cpu_s=meter.cpu_s,
        wall_s=meter.wall_s,
        preempted=meter.preempted,
        stall_max_ms=stall,
        batch_max_ms=batch,
        gc_max_ms=collection,
    )


def _disturbances(meter: Meter, cancelled: Sequence[StreamRecord]) -> tuple[float, float, float]:
    """Milliseconds: the worst OS stall, loop batch and collection while cancels were served."""
    starts = [rec.cancel_at for rec in cancelled if rec.cancel_at is not None]
    ends = [rec.closed_at for rec in cancelled if rec.closed_at is not None]
    if not starts or not ends:
        return 0.0, 0.0, 0.0
    first, last = min(starts), max(ends)
    batches = [b for b in meter.batches if first <= b.at <= last]
    collections = [c for c in meter.collections if first <= c.at <= last]
    return (
        1e3 * max((b.stolen for b in batches), default=0.0),
        1e3 * max((b.cpu for b in batches), default=0.0),
        1e3 * max((c.wall for c in collections), default=0.0),
    )
