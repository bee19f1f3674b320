"""The three cancellation strategies the benchmark compares, behind one small interface.

Every approach opens a caller-side stream for one request and hands the
benchmark a way to cancel it (``StreamRecord.cancel``), the way a disconnect
callback would; what each does at the engine afterwards is in
docs/benchmarks.md ("The baselines"). ``engine-alone`` (``FLOORS``) is no
strategy but a floor: the engine stream read in the consumer's own task inside
a cancel scope, so that a cancelled pull runs only the engine's release path.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import trio

import trio_sglang as ts
from trio_sglang_harness._scenarios import RidRecorder

__all__ = [
    "APPROACHES",
    "ENGINE_ALONE",
    "FLOORS",
    "Approach",
    "ApproachFactory",
    "StreamRecord",
    "open_approach",
]

#: What the consumer iterates: chunks of whatever shape the approach yields.
Chunks = AsyncIterator[object]

#: How long a baseline waits for anything at all after a cancel (first output,
#: registration): generous, because the old workers had no tighter bound.
LONG_WAIT = 30.0
#: Bound on closing an engine stream (a shielded cleanup step).
CLOSE_BOUND = 1.0


def _never_cancel() -> None:
    raise RuntimeError("cancel() called before the stream was opened")


@dataclass(slots=True, eq=False)
class StreamRecord:
    """One benchmarked stream: its schedule, and what was observed, in trio-clock seconds."""

    #: Seconds after the stream started at which it is cancelled.
    offset: float
    #: Seconds after its wave was open at which the stream starts (first pull, or the
    #: wait before it).
    start_delay: float = 0.0
    #: The engine rid (the benchmark's view; never shown to a caller).
    rid: str = ""
    #: Cancels the stream the way the caller's side would; set by the approach.
    cancel: Callable[[], None] = _never_cancel
    opened_at: float | None = None
    started_at: float | None = None
    cancel_at: float | None = None
    closed_at: float | None = None
    #: Chunks the consumer received before the cancel.
    chunks: int = 0
    #: Where the request was when it was cancelled (see ``observe_phase``).
    observed_phase: str = ""


class Approach(Protocol):
    """A cancellation strategy bound to one running engine."""

    def stream(
        self, request: Mapping[str, Any], rec: StreamRecord
    ) -> AbstractAsyncContextManager[Chunks]:
        """Open one request's stream; set ``rec.rid`` and ``rec.cancel`` before yielding."""
        ...

    @property
    def pending(self) -> int:
        """Tasks the approach still runs; once every stream closed, its engine-side cleanup."""
        ...


ApproachFactory = Callable[[ts.Engine], AbstractAsyncContextManager[Approach]]


# -- trio-sglang ---------------------------------------------------------------


class TrioSglang:
    """This project's lifecycle: ``worker.generate`` and ``ctx.kill()``."""

    def __init__(self, worker: ts.Worker, engine: RidRecorder) -> None:
        self._worker = worker
        self._engine = engine
        self._claimed: set[str] = set()

    @property
    def pending(self) -> int:
        return self._worker.pending_cleanups

    @asynccontextmanager
    async def stream(self, request: Mapping[str, Any], rec: StreamRecord) -> AsyncIterator[Chunks]:
        ctx = ts.RequestContext(f"bench-{len(self._claimed)}")
        rec.cancel = ctx.kill
        async with self._worker.generate(request, ctx, output="tokens") as chunks:
            rid = self._engine.last_rid
            if not isinstance(rid, str) or rid in self._claimed:
                # The recorder's rid is this stream's only if nothing ran between its
                # ``generate`` and here (no checkpoint: docs/benchmarks.md, "The baselines").
                raise RuntimeError("could not tell this stream's engine rid")
            self._claimed.add(rid)
            rec.rid = rid
            yield chunks


@asynccontextmanager
async def _open_trio_sglang(engine: ts.Engine) -> AsyncIterator[Approach]:
    recording = RidRecorder(engine)
    async with ts.open_worker(recording) as worker:
        yield TrioSglang(worker, recording)


# -- the baselines -----------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Handle:
    """One baseline stream: the engine stream, owned by its pump task alone."""

    rid: str
    stream: ts.EngineStream
    #: The id learned from the first output (what the old worker could abort by).
    engine_id: str | None = None
    #: An abort was sent by this handle's strategy.
    aborted: bool = False
    #: The engine stream ran to its end: nothing to clean up.
    ended: bool = False
    #: The consumer asked for its first chunk: the engine stream may start.
    wanted: bool = False
    #: The consumer left.
    gone: bool = False
    #: Set when either of the two above changes.
    wake: trio.Event = field(default_factory=trio.Event)
    #: The pump's scope; its deadline is set when the consumer leaves.
    pump_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: Set when the pump ended: the server's side of the stream is gone.
    done: trio.Event = field(default_factory=trio.Event)


class _PumpedChunks:
    """The consumer's side of a baseline stream: outputs handed over by the pump."""

    def __init__(self, handle: _Handle, receive: trio.MemoryReceiveChannel[dict[str, Any]]):
        self._handle = handle
        self._receive = receive

    def __aiter__(self) -> _PumpedChunks:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self._handle.wanted:
            self._handle.wanted = True
            self._handle.wake.set()
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def server_ended(self) -> None:
        """Until the pump is done with the engine stream (the handler's stream ended)."""
        await self._handle.done.wait()


class _Baseline(ABC):
    """What both baselines share: the asyncio worker's shape, modelled in trio with a pump
    task that owns the engine stream (docs/benchmarks.md, "The baselines")."""

    #: How long the pump may go on after the consumer left.
    pump_bound_after_leave: float = LONG_WAIT

    def __init__(self, engine: ts.Engine, nursery: trio.Nursery) -> None:
        self._engine = engine
        self._nursery = nursery
        self._pending = 0

    @property
    def pending(self) -> int:
        return self._pending

    @asynccontextmanager
    async def stream(
        self, request: Mapping[str, Any], rec: StreamRecord
    ) -> AsyncIterator[_PumpedChunks]:
        rid = uuid.uuid4().hex
        rec.rid = rid
        handle = _Handle(rid, self._engine.generate({**request, "rid": rid, "stream": True}))
        send, receive = trio.open_memory_channel[dict[str, Any]](0)
        self._spawn(partial(self._pump, handle, send))
        consumer_scope = trio.CancelScope()
        rec.cancel = consumer_scope.cancel
        try:
            with consumer_scope:
                yield _PumpedChunks(handle, receive)
        finally:
            receive.close()
            handle.gone = True
            handle.wake.set()
            handle.pump_scope.deadline = trio.current_time() + self.pump_bound_after_leave
            if not handle.ended:
                self._consumer_left(handle)

    def _spawn(self, task: Callable[[], Awaitable[None]]) -> None:
        """Start a detached task that ``pending`` counts until it ends."""
        self._pending += 1

        async def counted() -> None:
            try:
                await task()
            finally:
                self._pending -= 1

        self._nursery.start_soon(counted)

    async def _pump(self, handle: _Handle, send: trio.MemorySendChannel[dict[str, Any]]) -> None:
        try:
            with handle.pump_scope:
                await handle.wake.wait()
                if handle.wanted:
                    await self._pump_outputs(handle, send)
        finally:
            send.close()
            with trio.move_on_after(CLOSE_BOUND, shield=True):
                await handle.stream.aclose()
            handle.done.set()

    async def _pump_outputs(
        self, handle: _Handle, send: trio.MemorySendChannel[dict[str, Any]]
    ) -> None:
        async for out in handle.stream:
            if handle.engine_id is None:
                handle.engine_id = str(out["meta_info"]["id"])
            if not handle.gone:
                try:
                    await send.send(out)
                    continue
                except trio.BrokenResourceError:
                    pass  # the consumer left while this output was on its way
            if await self._done_after_output(handle):
                return
        handle.ended = True

    @abstractmethod
    def _consumer_left(self, handle: _Handle) -> None:
        """React to the consumer leaving (synchronously, from its exit path)."""

    @abstractmethod
    async def _done_after_output(self, handle: _Handle) -> bool:
        """Called for each output pulled after the consumer left; True ends the pump."""


class FirstResponse(_Baseline):
    """The old Dynamo worker: abort by the id the first output revealed, never earlier."""

    def _consumer_left(self, handle: _Handle) -> None:
        if handle.engine_id is not None:
            self._spawn(partial(self._abort_once, handle))

    async def _done_after_output(self, handle: _Handle) -> bool:
        await self._abort_once(handle)
        return True

    async def _abort_once(self, handle: _Handle) -> None:
        if not handle.aborted and handle.engine_id is not None:
            handle.aborted = True
            await self._engine.abort(handle.engine_id)


class PollThenAbort(_Baseline):
    """A model of Dynamo 1.6's ordered abort, with its draining and retries (the retries
    are exactly what SGLang's ``abort_sent`` flag drops)."""

    DRAIN_BOUND = 1.0
    REGISTRATION_WAIT = 30.0
    DISPATCH_WAIT = 0.25
    POLL_FIRST, POLL_MAX = 0.001, 0.05
    RETRIES = 8
    RETRY_FIRST, RETRY_MAX = 0.05, 1.0

    pump_bound_after_leave = DRAIN_BOUND

    def _consumer_left(self, handle: _Handle) -> None:
        if handle.wanted:  # the monitor task lives in the handler: only once it ran
            self._spawn(partial(self._abort, handle.rid))

    async def _done_after_output(self, handle: _Handle) -> bool:
        return False  # keep draining until the stream ends or the drain bound

    async def _abort(self, rid: str) -> None:
        engine = self._engine
        absent, registered = ts.RequestPhase.ABSENT, ts.RequestPhase.REGISTERED
        if not await self._poll_while(rid, absent, self.REGISTRATION_WAIT):
            return  # never registered: nothing to abort
        dispatched = await self._poll_while(rid, registered, self.DISPATCH_WAIT)
        if engine.phase(rid) is absent:
            return  # already released or finished
        await engine.abort(rid)
        if dispatched:
            return
        delay = self.RETRY_FIRST
        for _ in range(self.RETRIES):
            await trio.sleep(delay)
            delay = min(2 * delay, self.RETRY_MAX)
            if engine.phase(rid) is absent:
                return
            await engine.abort(rid)

    async def _poll_while(self, rid: str, phase: ts.RequestPhase, bound: float) -> bool:
        """Poll with backoff until ``rid`` leaves ``phase``; False if not within ``bound``."""
        delay = self.POLL_FIRST
        with trio.move_on_after(bound):
            while self._engine.phase(rid) is phase:
                await trio.sleep(delay)
                delay = min(2 * delay, self.POLL_MAX)
            return True
        return False


def _baseline_factory(kind: type[_Baseline]) -> ApproachFactory:
    @asynccontextmanager
    async def open_baseline(engine: ts.Engine) -> AsyncIterator[Approach]:
        async with engine.running(), trio.open_nursery() as nursery:
            yield kind(engine, nursery)
            # Whatever the settle left running is cut off with the cell.
            nursery.cancel_scope.cancel()

    return open_baseline


# -- the floor: the engine alone ----------------------------------------------------


class EngineAlone:
    """The engine stream, read in the consumer's task: the engine's release path, nothing else."""

    def __init__(self, engine: ts.Engine) -> None:
        if not engine.features().release_on_close:
            raise ValueError("engine-alone stops requests only on an engine that releases on close")
        self._engine = engine

    @property
    def pending(self) -> int:
        return 0  # it starts no task: the cancelled pull released the request

    @asynccontextmanager
    async def stream(self, request: Mapping[str, Any], rec: StreamRecord) -> AsyncIterator[Chunks]:
        rec.rid = uuid.uuid4().hex
        with trio.CancelScope() as scope:
            rec.cancel = scope.cancel
            yield self._engine.generate({**request, "rid": rec.rid, "stream": True})


@asynccontextmanager
async def _open_engine_alone(engine: ts.Engine) -> AsyncIterator[Approach]:
    async with engine.running():
        yield EngineAlone(engine)


APPROACHES: dict[str, ApproachFactory] = {
    "trio-sglang": _open_trio_sglang,
    "first-response": _baseline_factory(FirstResponse),
    "poll-then-abort": _baseline_factory(PollThenAbort),
}

ENGINE_ALONE = "engine-alone"
#: Not strategies: what the same harness costs with no lifecycle (see the module's docstring).
FLOORS: dict[str, ApproachFactory] = {ENGINE_ALONE: _open_engine_alone}


def open_approach(name: str, engine: ts.Engine) -> AbstractAsyncContextManager[Approach]:
    """Run ``engine`` with the named approach (or floor) on top, for the life of the block."""
    return {**APPROACHES, **FLOORS}[name](engine)
