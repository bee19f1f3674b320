"""What the SimEngine records, so tests and benchmarks can judge a lifecycle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
    "released",  # the tokenizer side dropped an undispatched state
]


@dataclass(frozen=True, slots=True)
class TraceEvent:
    time: float
    kind: TraceKind
    rid: str
    detail: str = ""


class Trace(list[TraceEvent]):
    """A list of ``TraceEvent``, stamped with the trio clock as they happen."""

    def record(self, kind: TraceKind, rid: str, detail: str = "") -> None:
        self.append(TraceEvent(trio.current_time(), kind, rid, detail))

    def of(self, rid: str) -> list[TraceEvent]:
        """The events of one rid, in order."""
        return [event for event in self if event.rid == rid]

    def kinds(self, rid: str) -> list[TraceKind]:
        return [event.kind for event in self if event.rid == rid]
