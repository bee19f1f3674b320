"""What the SimEngine records, so tests and benchmarks can judge a lifecycle."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple, overload

import trio

__all__ = ["Trace", "TraceEvent", "TraceKind"]

TraceKind = Literal[
    "registered",  # the tokenizer side put the rid in its registry
    "dispatched",  # the request was pushed to the scheduler (timestamp set)
    "token",  # the scheduler decoded one token
    "finished",  # the scheduler finished the request on its own (length)
    "abort_requested",  # abort_request sent an AbortReq to the scheduler
    "abort_dropped",  # abort_request ignored: unknown rid, or abort already sent
    "abort_applied",  # the scheduler stopped a request it held
    "abort_lost",  # the scheduler got an abort that matched nothing
    "abort_missed",  # the scheduler missed an abort of a request it held (``missed_aborts``)
    "abort_resent",  # an abort went to the scheduler again, past abort_request's flag
    "released",  # the tokenizer side dropped an undispatched state
    # Prefill/decode disaggregation (detail: the bootstrap room, or the chunk size):
    "bootstrapped",  # the two sides' handshake on the room is done
    "prefill_chunk",  # the prefill side ran one chunk's forward
    "kv_sent",  # the prefill side finished sending the KV cache
    "kv_received",  # the decode side has the KV cache and starts decoding
    "kv_failed",  # the prefill side dropped a request whose decode side aborted
    "kv_timeout",  # the decode side gave up waiting for the KV cache
]


class TraceEvent(NamedTuple):
    """One thing the SimEngine did."""

    time: float
    kind: TraceKind
    rid: str
    detail: str = ""


class Trace(Sequence[TraceEvent]):
    """Every ``TraceEvent`` in order, stamped with the trio clock as it happens.

    Read it as a list of events: index it, slice it (a list), iterate it, or
    compare it with a list. It keeps them as one column per field, not as
    event objects: a burst of 10,000 requests records tens of thousands of
    events, and a tuple per event (a named tuple, even of plain values, stays
    tracked) would be as many objects for every full collection to walk,
    where floats and strings in four lists are nothing it walks.

    ``counts`` (events per kind) is always kept. The events themselves are
    kept unless ``keep_events`` is false: a test or benchmark reads them
    afterwards, but a long-running server would grow the columns without
    bound, so it keeps counts only.
    """

    __slots__ = ("_details", "_kinds", "_rids", "_times", "counts", "keep_events")

    def __init__(self, *, keep_events: bool = True) -> None:
        self.keep_events = keep_events
        self.counts: Counter[TraceKind] = Counter()
        self._times: list[float] = []
        self._kinds: list[TraceKind] = []
        self._rids: list[str] = []
        self._details: list[str] = []

    def record(self, kind: TraceKind, rid: str, detail: str = "") -> None:
        self.counts[kind] += 1
        if self.keep_events:
            self._times.append(trio.current_time())
            self._kinds.append(kind)
            self._rids.append(rid)
            self._details.append(detail)

    def __len__(self) -> int:
        return len(self._times)

    @overload
    def __getitem__(self, index: int) -> TraceEvent: ...

    @overload
    def __getitem__(self, index: slice) -> list[TraceEvent]: ...

    def __getitem__(self, index: int | slice) -> TraceEvent | list[TraceEvent]:
        if isinstance(index, slice):
            columns = (self._times, self._kinds, self._rids, self._details)
            return list(
                map(TraceEvent._make, zip(*(column[index] for column in columns), strict=True))
            )
        return TraceEvent(
            self._times[index], self._kinds[index], self._rids[index], self._details[index]
        )

    def __iter__(self) -> Iterator[TraceEvent]:
        return map(TraceEvent._make, self._rows())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Trace | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"Trace({list(self)!r})"

    def of(self, rid: str) -> list[TraceEvent]:
        """The events of one rid, in order (made only for that rid's events)."""
        return [TraceEvent._make(row) for row in self._rows() if row[2] == rid]

    def kinds(self, rid: str) -> list[TraceKind]:
        return [kind for kind, of in zip(self._kinds, self._rids, strict=True) if of == rid]

    def _rows(self) -> Iterator[tuple[float, TraceKind, str, str]]:
        """The events' fields, row by row, as plain tuples."""
        return zip(self._times, self._kinds, self._rids, self._details, strict=True)
