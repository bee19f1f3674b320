"""The SimEngine's prefill/decode disaggregation: SGLang 0.5.23's queues and their aborts.

A disaggregated request runs twice, once on a prefill engine and once on a
decode engine, paired by its ``bootstrap_room``. What is modelled, from
SGLang's ``srt/disaggregation/prefill.py`` and ``decode.py``:

Prefill (``max_new_tokens`` forced to 1): the *bootstrap* queue waits for the
decode side's handshake on the room; the *waiting* queue holds it until the
one forward loop is free (a prefill GPU runs one forward at a time, so a
dead request ahead delays every later one); *prefilling* runs the prompt in
chunks; *transferring* sends the KV cache. It then answers with one token
and ``{"type": "length", "length": 0}``. An abort in bootstrap or transfer
fails the room (500); in waiting it is removed (echoed); while prefilling it
takes effect only after the current chunk's forward. None of these tells
the decode side, which keeps waiting for the KV cache until its timeout. A
decode side that never makes its handshake fails the request after
``bootstrap_timeout`` (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, 300 s).

Decode: the *prealloc* queue makes the handshake (``bootstrap_delay``); the
*transfer* queue waits for the KV cache (at most ``kv_wait_timeout``, 300 s
in SGLang); then it decodes as an aggregated engine does, its first token
``first_token_delay`` after the KV cache arrived. An abort in prealloc or
transfer fails the room; once the handshake is done (in transfer) it also
notifies the prefill side, which drops the request if it is still
bootstrapping and otherwise notices only when it tries to transfer. An
abort during the handshake tells the prefill side nothing (SGLang sends its
notification only once it has the prefill side's bootstrap info), so that
side waits out its bootstrap timeout.

Rooms of an expanded request are SGLang's: a scalar ``bootstrap_room`` on
a native batch or ``n > 1`` becomes ``room + i`` for the i-th child; a list
gives each prompt its own.

The conformance harness's stand-in scheduler models the same queues
(``trio_sglang_harness._pd_queues``) with this timing and these abort texts,
but not this code: it runs in SGLang's scheduler process with no trio,
against a scripted peer whose every event is due at a known time, where
here each stage is a trio task waiting on a live peer's room events.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import trio

from .._kv_rooms import BootstrapAddr, KVRooms, RoomEvent
from .._request._values import check_at_least
from ._scheduler import OutputSink, SimScheduler, SimTiming
from ._trace import Trace, TraceKind

__all__ = [
    "ABORTED",
    "NO_ROOM",
    "DisaggregationMode",
    "SimDecodeScheduler",
    "SimDisaggTiming",
    "SimKVRooms",
    "SimPrefillScheduler",
    "abort_reason",
    "kv_timed_out",
    "room_failed",
]

DisaggregationMode = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class SimDisaggTiming:
    """Seconds on the trio clock, and the prefill's chunk size in prompt tokens."""

    #: A disaggregated prefill's compute per prompt token; a prompt word is a
    #: token.
    prefill_time_per_token: float = 0.0001
    #: Prompt tokens per prefill forward (SGLang's chunked prefill); a cancel
    #: takes effect between forwards.
    prefill_chunk_tokens: int = 256
    #: The decode side's handshake with the prefill side's bootstrap server.
    bootstrap_delay: float = 0.002
    #: Sending the KV cache from the prefill side to the decode side.
    kv_transfer_delay: float = 0.005
    #: How long the decode side waits for a KV cache; the default is SGLang's
    #: (SGLANG_DISAGGREGATION_WAITING_TIMEOUT).
    kv_wait_timeout: float = 300.0
    #: How long prefill waits for the decode side's handshake
    #: (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT).
    bootstrap_timeout: float = 300.0

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if name == "prefill_chunk_tokens":
                check_at_least(name, getattr(self, name), 1, integer=True)
            else:
                check_at_least(name, getattr(self, name), 0, finite=True)


@dataclass(slots=True)
class _Room:
    events: set[RoomEvent] = field(default_factory=set)
    lot: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)
    #: Sides that are done with the room; it is forgotten when both are.
    done: int = 0


class SimKVRooms:
    """``KVRooms`` in one process: share one between a prefill and a decode ``SimEngine``.

    It is also what a prefill server hosts for decode servers in other
    processes (``trio_sglang.server``); either way the room's address does
    not matter here.

    A room is forgotten when both sides are done with it, or ``forget_after``
    seconds after it was made if nobody waits on it then: a side that never
    came (its request was released before dispatch), or a peer that made a
    room and went. SGLang's bootstrap server gives up on a room after its
    bootstrap timeout (300 s) too, and a long-running server must not keep
    such rooms for ever. A room someone waits on is looked at again
    ``forget_after`` later; one made again after it was forgotten starts anew.
    """

    def __init__(self, *, forget_after: float = 300.0) -> None:
        check_at_least("forget_after", forget_after, 0, finite=True)
        self._forget_after = forget_after
        self._rooms: dict[int, _Room] = {}
        #: (when to forget it, room, its state then), oldest first: every room made.
        self._due: deque[tuple[float, int, _Room]] = deque()

    def __len__(self) -> int:
        self._forget_abandoned()
        return len(self._rooms)

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def _room(self, room: int) -> _Room:
        state = self._rooms.get(room)
        if state is None:
            self._forget_abandoned()
            state = self._rooms[room] = _Room()
            self._due.append((trio.current_time() + self._forget_after, room, state))
        return state

    def post(self, room: int, event: RoomEvent, at: BootstrapAddr | None = None) -> None:
        state = self._room(room)
        state.events.add(event)
        state.lot.unpark_all()

    def happened(self, room: int, event: RoomEvent, at: BootstrapAddr | None = None) -> bool:
        state = self._rooms.get(room)
        return state is not None and event in state.events

    async def wait(
        self, room: int, wanted: frozenset[RoomEvent], at: BootstrapAddr | None = None
    ) -> frozenset[RoomEvent]:
        """Those of ``wanted`` that have happened to ``room``, once one has; unbounded."""
        state = self._room(room)
        try:
            while not (state.events & wanted):
                await state.lot.park()
        finally:
            if not (state.events or state.lot or state.done) and self._rooms.get(room) is state:
                # A cancelled wait on a room nobody else ever touched.
                del self._rooms[room]
        return frozenset(state.events & wanted)

    def side_done(self, room: int, at: BootstrapAddr | None = None) -> None:
        state = self._rooms.get(room)
        if state is None:
            return
        state.done += 1
        if state.done >= 2:
            del self._rooms[room]
        self._forget_abandoned()

    def _forget_abandoned(self) -> None:
        now = trio.current_time()
        while self._due and self._due[0][0] <= now:
            _, room, state = self._due.popleft()
            if self._rooms.get(room) is not state:
                continue  # forgotten already (and maybe made again: its own entry)
            if state.lot:
                self._due.append((now + self._forget_after, room, state))
            else:
                del self._rooms[room]


@dataclass(slots=True, eq=False)
class _Staged:
    rid: str
    seed: int
    max_new_tokens: int
    prompt_tokens: int
    room: int
    at: BootstrapAddr
    stage: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    abort_pending: bool = False


class _DisaggScheduler(SimScheduler, ABC):
    """Requests go through this side's queues before (or instead of) decoding."""

    def __init__(
        self,
        timing: SimTiming,
        disagg: SimDisaggTiming,
        rooms: KVRooms,
        trace: Trace,
        sink: OutputSink,
    ) -> None:
        super().__init__(timing, trace, sink)
        self._disagg = disagg
        self._rooms = rooms
        self._staged: dict[str, _Staged] = {}
        self._stages: trio.Nursery | None = None

    def holds(self, rid: str) -> bool:
        return rid in self._staged or super().holds(rid)

    def rids(self) -> set[str]:
        return set(self._staged) | super().rids()

    def add_request(
        self,
        rid: str,
        seed: int,
        max_new_tokens: int,
        prompt_tokens: int = 0,
        room: int | None = None,
        at: BootstrapAddr | None = None,
    ) -> None:
        if room is None:
            # What SGLang's scheduler answers a disaggregated request without a room.
            self._trace.record("abort_applied", rid, "no bootstrap room")
            self._sink(rid, [], abort_reason(NO_ROOM, 400))
            return
        staged = _Staged(
            rid, seed, max_new_tokens, prompt_tokens, room, at or BootstrapAddr(), self._first_stage
        )
        self._staged[rid] = staged
        assert self._stages is not None, "the scheduler runs while the engine does"
        self._stages.start_soon(self._run_stages, staged)

    async def run(self) -> None:
        async with trio.open_nursery() as self._stages:
            await super().run()

    def _matching(self, prefix: str) -> list[str]:
        return [rid for rid in self._staged if rid.startswith(prefix)]

    def abort(self, prefix: str) -> None:
        staged = self._matching(prefix)
        if not staged:
            super().abort(prefix)
            return
        for rid in staged:
            self._abort_staged(self._staged[rid])

    def _holds(self, staged: _Staged) -> bool:
        """Whether ``staged`` is still here (an abort and a wake-up can meet in one tick)."""
        return self._staged.get(staged.rid) is staged

    def _end_staged(self, staged: _Staged, reason: dict[str, Any], token: list[int]) -> None:
        if not self._holds(staged):
            return
        del self._staged[staged.rid]
        staged.scope.cancel()
        self._rooms.side_done(staged.room, staged.at)
        self._sink(staged.rid, token, reason)

    def _aborted(self, staged: _Staged, reason: dict[str, Any]) -> None:
        if not self._holds(staged):
            return
        self._trace.record("abort_applied", staged.rid, staged.stage)
        self._end_staged(staged, reason, [])

    #: The queue a request enters on dispatch.
    _first_stage: ClassVar[str]

    @abstractmethod
    async def _run_stages(self, staged: _Staged) -> None:
        """Take one request through this side's queues (its task, in the scheduler's nursery)."""

    @abstractmethod
    def _abort_staged(self, staged: _Staged) -> None:
        """Apply an abort to a request in this side's queues, as SGLang does in each."""


class SimPrefillScheduler(_DisaggScheduler):
    _first_stage = "bootstrap"

    def __init__(
        self,
        timing: SimTiming,
        disagg: SimDisaggTiming,
        rooms: KVRooms,
        trace: Trace,
        sink: OutputSink,
    ) -> None:
        super().__init__(timing, disagg, rooms, trace, sink)
        self._waiting: deque[_Staged] = deque()
        self._forward_free = trio.lowlevel.ParkingLot()
        self._forwarding: _Staged | None = None

    async def _run_stages(self, staged: _Staged) -> None:
        with staged.scope:
            events: frozenset[RoomEvent] = frozenset()
            with trio.move_on_after(self._disagg.bootstrap_timeout):
                events = await self._rooms.wait(
                    staged.room, frozenset({"decode_ready", "decode_aborted"}), staged.at
                )
            if not events:
                self._trace.record("kv_timeout", staged.rid, "bootstrap")
                timeout = self._disagg.bootstrap_timeout
                why = kv_timed_out(staged.room, timeout, "Bootstrapping")
                self._failed(staged, "Prefill bootstrap failed", why, None)
                return
            if "decode_aborted" in events:
                self._failed(staged, "Prefill bootstrap failed", "decode aborted", "kv_failed")
                return
            self._trace.record("bootstrapped", staged.rid, str(staged.room))
            staged.stage = "waiting"
            self._waiting.append(staged)
            while self._forwarding is not None or self._waiting[0] is not staged:
                await self._forward_free.park()
            self._waiting.popleft()
            self._forwarding = staged
            staged.stage = "prefilling"
            try:
                await self._prefill(staged)
            finally:
                self._forwarding = None
                self._forward_free.unpark_all()
            if staged.abort_pending:
                self._aborted(staged, abort_reason("Aborted", None))
                return
            staged.stage = "transferring"
            if self._rooms.happened(staged.room, "decode_aborted", staged.at):
                self._failed(staged, "Prefill transfer failed", "decode aborted", "kv_failed")
                return
            await trio.sleep(self._disagg.kv_transfer_delay)
            self._rooms.post(staged.room, "kv_sent", staged.at)
            self._trace.record("kv_sent", staged.rid, str(staged.room))
            token = (staged.seed + 7919) % 64
            self._trace.record("finished", staged.rid)
            self._end_staged(staged, {"type": "length", "length": 0}, [token])

    async def _prefill(self, staged: _Staged) -> None:
        """One forward per chunk; an abort is seen only between forwards."""
        left = staged.prompt_tokens
        while left > 0 and not staged.abort_pending:
            chunk = min(left, self._disagg.prefill_chunk_tokens)
            await trio.sleep(chunk * self._disagg.prefill_time_per_token)
            left -= chunk
            self._trace.record("prefill_chunk", staged.rid, str(chunk))

    def _abort_staged(self, staged: _Staged) -> None:
        if staged.stage == "bootstrap":
            self._failed(staged, "Prefill bootstrap failed", ABORTED)
        elif staged.stage == "waiting":
            self._waiting.remove(staged)
            self._forward_free.unpark_all()
            self._aborted(staged, abort_reason("Abort in waiting queue", None))
        elif staged.stage == "prefilling":
            staged.abort_pending = True  # applied after this chunk's forward
        else:
            self._failed(staged, "Prefill transfer failed", ABORTED)

    def _failed(
        self, staged: _Staged, what: str, why: str, kind: TraceKind | None = "abort_applied"
    ) -> None:
        """End a request whose room failed; ``kind`` is its trace event, if not yet recorded."""
        if not self._holds(staged):
            return
        if kind is not None:
            self._trace.record(kind, staged.rid, staged.stage)
        self._end_staged(staged, room_failed(what, staged.rid, staged.room, why), [])


class SimDecodeScheduler(_DisaggScheduler):
    _first_stage = "prealloc"

    async def _run_stages(self, staged: _Staged) -> None:
        with staged.scope:
            await trio.sleep(self._disagg.bootstrap_delay)
            self._rooms.post(staged.room, "decode_ready", staged.at)
            self._trace.record("bootstrapped", staged.rid, str(staged.room))
            staged.stage = "transfer"
            with trio.move_on_after(self._disagg.kv_wait_timeout):
                await self._rooms.wait(staged.room, frozenset({"kv_sent"}), staged.at)
                if not self._holds(staged):
                    return
                self._trace.record("kv_received", staged.rid, str(staged.room))
                del self._staged[staged.rid]
                self._rooms.side_done(staged.room, staged.at)
                SimScheduler.add_request(self, staged.rid, staged.seed, staged.max_new_tokens)
                return
            self._trace.record("kv_timeout", staged.rid, str(staged.room))
            timeout = self._disagg.kv_wait_timeout
            why = kv_timed_out(staged.room, timeout, "WaitingForInput")
            failed = room_failed("Decode transfer failed", staged.rid, staged.room, why)
            self._end_staged(staged, failed, [])

    def _abort_staged(self, staged: _Staged) -> None:
        if staged.stage == "transfer":  # the handshake gave it the prefill side's address
            self._rooms.post(staged.room, "decode_aborted", staged.at)  # the AbortNotification
        what = "Decode handshake failed" if staged.stage == "prealloc" else "Decode transfer failed"
        self._aborted(staged, room_failed(what, staged.rid, staged.room, ABORTED))


# -- what SGLang streams when a disaggregated request ends in an abort --------------
# Shared with the stand-in scheduler's queues (``trio_sglang_harness``), so that
# both sides of a conformance comparison answer in SGLang's words.

#: The scheduler's answer (400) to a disaggregated request that came without a room.
NO_ROOM = "Invalid request: Disaggregated request received without bootstrap room id."
#: Why a room failed when this side's own ``AbortReq`` failed it.
ABORTED = "Aborted by AbortReq."


def abort_reason(message: str, status_code: int | None) -> dict[str, Any]:
    """SGLang's abort finish reason."""
    return {"type": "abort", "message": message, "status_code": status_code}


def room_failed(what: str, rid: str, room: int, why: str) -> dict[str, Any]:
    """The 500 abort of a failed room, worded as SGLang's (``{req.rid=}``, so quoted).

    ``what`` is the queue's failure (``"Prefill bootstrap failed"``, ...),
    ``why`` the ``KVTransferError``'s text.
    """
    message = (
        f"{what} for request rank=0 req.rid={rid!r} req.bootstrap_room={room} "
        f"with exception KVTransferError(bootstrap_room={room}): {why}"
    )
    return abort_reason(message, 500)


def kv_timed_out(room: int, seconds: float, poll: str) -> str:
    """A room's timeout, as SGLang's ``KVTransferError`` says it; ``poll``: a ``KVPoll`` state."""
    return f"Request {room} timed out after {seconds}s in KVPoll.{poll}"
