"""What the SimEngine records, so tests and benchmarks can judge a lifecycle."""

from __future__ import annotations

from collections import Counter
from typing import Literal, NamedTuple

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
    # Prefill/decode disaggregation (detail: the bootstrap room, or the chunk size):
    "bootstrapped",  # the two sides' handshake on the room is done
    "prefill_chunk",  # the prefill side ran one chunk's forward
    "kv_sent",  # the prefill side finished sending the KV cache
    "kv_received",  # the decode side has the KV cache and starts decoding
    "kv_failed",  # the prefill side dropped a request whose decode side aborted
    "kv_timeout",  # the decode side gave up waiting for the KV cache
]


class TraceEvent(NamedTuple):
    """One thing the SimEngine did. A tuple of plain values: the collector stops
    tracking it after one pass, so a long trace costs full collections nothing."""

    time: float
    kind: TraceKind
    rid: str
    detail: str = ""


class Trace(list[TraceEvent]):
    """A list of ``TraceEvent``, stamped with the trio clock as they happen.

    ``counts`` (events per kind) is always kept. The events themselves are
    kept unless ``keep_events`` is false: a test or benchmark reads them
    afterwards, but a long-running server would grow the list without bound
    (and every full garbage collection would walk it), so it keeps counts only.
    """

    def __init__(self, *, keep_events: bool = True) -> None:
        super().__init__()
        self.keep_events = keep_events
        self.counts: Counter[TraceKind] = Counter()

    def record(self, kind: TraceKind, rid: str, detail: str = "") -> None:
        self.counts[kind] += 1
        if self.keep_events:
            self.append(TraceEvent(trio.current_time(), kind, rid, detail))

    def of(self, rid: str) -> list[TraceEvent]:
        """The events of one rid, in order."""
        return [event for event in self if event.rid == rid]

    def kinds(self, rid: str) -> list[TraceKind]:
        return [event.kind for event in self if event.rid == rid]
