"""The stand-in scheduler's prefill or decode queues, with the peer script playing the other side.

In a disaggregated role the stand-in scheduler (``_scheduler.py``) holds each
request in its role's queues before decoding it (decode) or instead (prefill).
The queues, their timing and how each takes an abort are the SimEngine's
model (``trio_sglang.sim._sim_disagg``, read off SGLang 0.5.23's
``srt/disaggregation``), so that the real TokenizerManager and the SimEngine
can be compared stage by stage; the other side of every room is the fixed
peer script of ``DisaggSetup``.

The two share their timing (``SimDisaggTiming``) and SGLang's abort texts,
not the queue code: this process has no trio (it is SGLang's scheduler
process, a blocking loop on ZMQ sockets), and its peer is a script, so every
stage ends at a time known in advance; the SimEngine's stages are trio tasks
that wait on a live peer's room events, possibly over HTTP.

Prefill: *bootstrap* until the peer's handshake; *waiting* for the one
forward slot; *prefilling* one chunk per forward (an abort takes effect
after the current chunk); *transferring* the KV cache; then one token with
``{"type": "length", "length": 0}``. An abort in bootstrap or transferring
fails the room (an abort finish reason with status 500, as SGLang's
``handle_bootstrap_failure`` and ``handle_inflight_transfer_failure`` stream
it); in waiting or prefilling the request is dropped and echoed (``AbortReq``).

Decode: *prealloc* until its own handshake; *transfer* until the peer's KV
cache arrives (or ``kv_wait_timeout``); then it decodes as the aggregated
stand-in does. An abort in prealloc or transfer fails the room (status 500);
the peer, seeing the room aborted, sends nothing.

A request without a ``bootstrap_room`` is answered at once with SGLang's 400
abort. This is a pure state machine on the loop's ``time.monotonic()``: the
loop admits and aborts, asks ``next_due`` and calls ``advance``; a request
that leaves the queues comes back as an ``Exit`` for the loop to put on the
wire (it owns the sockets and the decoding). Stage events go to the log.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from trio_sglang.sim._sim_disagg import ABORTED, NO_ROOM, abort_reason, kv_timed_out, room_failed

from ._peer import DisaggSetup

__all__ = ["EventLog", "Exit", "Queues", "queues_for"]

#: ``prefilled``: one token and length 0; ``failed``: no token and ``reason``;
#: ``echo``: an ``AbortReq`` echo; ``decode``: start decoding now.
ExitKind = Literal["prefilled", "failed", "echo", "decode"]
Stage = Literal["bootstrap", "waiting", "prefilling", "transferring", "prealloc", "transfer"]
#: What the loop keeps of a request; handed back in its ``Exit``.
R = TypeVar("R")


class EventLog(Protocol):
    def write(self, kind: str, rid: str | None, at: float | None = None, **details: Any) -> None:
        """One event, stamped ``at`` (now if None)."""
        ...


@dataclass(frozen=True, slots=True)
class Exit(Generic[R]):
    """A request leaving the queues, and how the loop answers it."""

    request: R
    kind: ExitKind
    #: ``failed``: the abort finish reason to send.
    reason: dict[str, Any] | None = None


@dataclass(slots=True, eq=False)
class _Queued(Generic[R]):
    request: R
    rid: str
    room: int
    #: Prompt tokens not prefilled yet (prefill).
    left: int
    stage: Stage
    #: When the current stage ends; ``math.inf`` while it waits for its turn.
    due: float
    abort_pending: bool = False


class Queues(ABC, Generic[R]):
    """One role's queues; a request is in exactly one stage until it exits."""

    def __init__(self, setup: DisaggSetup, log: EventLog) -> None:
        self._setup = setup
        self._timing = setup.timing
        self._log = log
        self._queued: dict[str, _Queued[R]] = {}  # insertion order = arrival order

    def rids(self) -> list[str]:
        """The rids held, in arrival order."""
        return list(self._queued)

    def next_due(self) -> float:
        return min((q.due for q in self._queued.values()), default=math.inf)

    def admit(
        self, request: R, rid: str, room: int | None, prompt_tokens: int, now: float
    ) -> Exit[R] | None:
        """Queue a new request; one without a room is refused at once."""
        if room is None:
            self._log.write("abort_applied", rid, stage="no bootstrap room")
            return Exit(request, "failed", abort_reason(NO_ROOM, 400))
        stage, lasts = self._arrival()
        self._queued[rid] = _Queued(request, rid, room, prompt_tokens, stage, now + lasts)
        return None

    def abort(self, rid: str) -> Exit[R] | None:
        """Abort a held request; ``None`` if that takes effect later (``advance`` says)."""
        queued = self._queued[rid]
        exit = self._abort(queued)
        if exit is not None:
            del self._queued[rid]
            self._log.write("abort_applied", rid, stage=queued.stage)
        return exit

    def advance(self, now: float) -> list[Exit[R]]:
        """End every stage that is due, in arrival order; the requests that left."""
        exits = []
        for queued in [q for q in self._queued.values() if q.due <= now]:
            exit = self._end_stage(queued, now)
            if exit is not None:
                del self._queued[queued.rid]
                exits.append(exit)
        return exits

    def _failed(self, queued: _Queued[R], what: str, why: str) -> Exit[R]:
        """SGLang's abort for a failed room (``KVTransferError`` in its message)."""
        return Exit(queued.request, "failed", room_failed(what, queued.rid, queued.room, why))

    @abstractmethod
    def _arrival(self) -> tuple[Stage, float]:
        """A new request's first stage, and how long it lasts."""

    @abstractmethod
    def _abort(self, queued: _Queued[R]) -> Exit[R] | None:
        """Apply an abort in the request's stage; what leaves the queues, if anything."""

    @abstractmethod
    def _end_stage(self, queued: _Queued[R], now: float) -> Exit[R] | None:
        """The request's stage is over: its next stage, or what leaves the queues."""


class _PrefillQueues(Queues[R]):
    def __init__(self, setup: DisaggSetup, log: EventLog) -> None:
        super().__init__(setup, log)
        self._waiting: deque[_Queued[R]] = deque()
        #: The request whose chunk is in the forward pass: one at a time.
        self._forwarding: _Queued[R] | None = None

    def _arrival(self) -> tuple[Stage, float]:
        return "bootstrap", self._setup.peer_delay  # until the decode side's handshake

    def _abort(self, queued: _Queued[R]) -> Exit[R] | None:
        if queued.stage == "bootstrap":
            return self._failed(queued, "Prefill bootstrap failed", ABORTED)
        if queued.stage == "waiting":
            self._waiting.remove(queued)
            return Exit(queued.request, "echo")
        if queued.stage == "prefilling":
            queued.abort_pending = True  # seen after this chunk's forward
            return None
        return self._failed(queued, "Prefill transfer failed", ABORTED)

    def _end_stage(self, queued: _Queued[R], now: float) -> Exit[R] | None:
        exit = None
        if queued.stage == "bootstrap":
            self._log.write("bootstrapped", queued.rid, room=queued.room)
            queued.stage, queued.due = "waiting", math.inf
            self._waiting.append(queued)
        elif queued.stage == "prefilling":
            exit = self._end_chunk(queued, now)
        else:  # transferring
            self._log.write("kv_sent", queued.rid, room=queued.room)
            exit = Exit(queued.request, "prefilled")
        if self._forwarding is None and self._waiting:
            self._forwarding = self._waiting.popleft()
            self._forwarding.stage = "prefilling"
            self._forwarding.due = now + self._chunk_time(self._forwarding)
        return exit

    def _chunk(self, queued: _Queued[R]) -> int:
        return min(queued.left, self._timing.prefill_chunk_tokens)

    def _chunk_time(self, queued: _Queued[R]) -> float:
        return self._chunk(queued) * self._timing.prefill_time_per_token

    def _end_chunk(self, queued: _Queued[R], now: float) -> Exit[R] | None:
        """A chunk's forward is done: then the next chunk, the transfer, or the pending abort."""
        if queued.left:
            chunk = self._chunk(queued)
            queued.left -= chunk
            self._log.write("prefill_chunk", queued.rid, tokens=chunk)
        if queued.left and not queued.abort_pending:
            queued.due = now + self._chunk_time(queued)
            return None
        self._forwarding = None
        if queued.abort_pending:
            self._log.write("abort_applied", queued.rid, stage=queued.stage)
            return Exit(queued.request, "echo")
        queued.stage, queued.due = "transferring", now + self._timing.kv_transfer_delay
        return None


class _DecodeQueues(Queues[R]):
    def _arrival(self) -> tuple[Stage, float]:
        return "prealloc", self._timing.bootstrap_delay  # until its own handshake

    def _abort(self, queued: _Queued[R]) -> Exit[R] | None:
        # The room fails; the peer sees it aborted and never sends the KV cache.
        what = "Decode handshake failed" if queued.stage == "prealloc" else "Decode transfer failed"
        return self._failed(queued, what, ABORTED)

    def _end_stage(self, queued: _Queued[R], now: float) -> Exit[R] | None:
        timeout = self._timing.kv_wait_timeout
        if queued.stage == "prealloc":
            self._log.write("bootstrapped", queued.rid, room=queued.room)
            queued.stage = "transfer"
            queued.due = now + min(self._setup.peer_delay, timeout)
            return None
        if self._setup.peer_delay < timeout:
            self._log.write("kv_received", queued.rid, room=queued.room)
            return Exit(queued.request, "decode")
        self._log.write("kv_timeout", queued.rid, room=queued.room)
        why = kv_timed_out(queued.room, timeout, "WaitingForInput")
        return self._failed(queued, "Decode transfer failed", why)


def queues_for(setup: DisaggSetup, log: EventLog) -> Queues[Any]:
    """The queues of ``setup.role`` (annotate the result with what the loop keeps)."""
    return (_PrefillQueues if setup.role == "prefill" else _DecodeQueues)(setup, log)
