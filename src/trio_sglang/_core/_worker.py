"""The cancellation lifecycle: ``open_worker`` and ``Worker.generate``.

One request's life, top to bottom:

1. ``generate`` checks the request (or takes what ``prepare`` checked), and
   that the engine honours every field it asks for (``InvalidRequest``
   before anything reaches the engine), mints the internal rids, and opens
   the caller's block inside a cancel scope that ``ctx.stop()``/``ctx.kill()``
   and the worker's shutdown cancel.
2. The caller pulls. Requests whose engine ids are known in advance (one
   prompt, or a native batch) on an engine whose close releases them are
   read by the caller's own task; the others by an ``EnginePump`` in the
   worker's ``CleanupGroup`` (see ``_pump.py``). A decode worker's request
   whose prefill runs elsewhere also gets a ``PrefillLeg`` there (see
   ``_disagg.py``).
3. The caller leaves, however it leaves. A cancelled pull has already run
   the engine's release path (an undispatched request is forgotten and never
   reaches the scheduler, a dispatched one is aborted after its dispatch);
   whatever still has to be awaited (closing the stream, confirming the
   abort took, the ordered fallback) runs in the ``CleanupGroup``, bounded
   by ``AbortPolicy`` (see ``_cleanup.py``), and never holds the caller's
   stream open.

The shape follows hypercorn's trio worker: the engine is entered first, the
``CleanupGroup`` is opened after it and closed before it, and leaving the
worker ends every open stream (its ``Drain``), then gives their cleanup what
is left of the grace as a deadline, and only then lets the engine close.

A stream knows its worker only through what it is given at its start: the
worker's ``EngineCleanup`` (which stops a request at the engine and reports
what the caller sees of its faults) and ``CleanupGroup`` (which owns the
prefill leg and the reader). The worker, for its part, is the stream's one
friend: it closes a stream when its block ends and cancels its scope at
shutdown (``_close``, ``_scope``), here in this module.
"""

from __future__ import annotations

import enum
import logging
import math
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import trio

from .._engine import Engine, EngineFeatures, Role
from .._errors import EngineError, EngineShutdown, InvalidRequest
from .._fields import check_honoured
from .._request import OutputMode, ParsedRequest, parse_request
from ._capabilities import build_capabilities
from ._cleanup import EngineCleanup, EngineRequest
from ._cleanup_group import CleanupGroup, open_cleanup_group
from ._context import RequestContext, attach, detach
from ._disagg import (
    PrefillLeg,
    PrefillPeer,
    needs_prefill_leg,
    new_bootstrap,
    peer_cancels_anytime,
)
from ._drain import Drain
from ._faults import FaultLog
from ._ids import mint_rid
from ._observer import WorkerObserver
from ._outputs import PublicIds, format_chunk
from ._policy import AbortPolicy
from ._pump import EnginePump

__all__ = ["Generation", "PreparedRequest", "ResponseStream", "Worker", "open_worker"]

logger = logging.getLogger("trio_sglang")


class StreamState(enum.Enum):
    #: Opened; nothing pulled, nothing at the engine.
    NEW = "new"
    #: Between pulls.
    OPEN = "open"
    #: Inside a pull.
    PULLING = "pulling"
    #: The engine stream ended by itself.
    FINISHED = "finished"
    #: Left early (cancelled, failed, closed); the engine side is the worker's.
    CLOSED = "closed"


# The pull is the hot path (one call per token), and looking up an enum
# member costs a class attribute access (~50 ns) where a global costs ~10.
_NEW, _OPEN, _PULLING = StreamState.NEW, StreamState.OPEN, StreamState.PULLING
_FINISHED, _CLOSED = StreamState.FINISHED, StreamState.CLOSED


class ResponseStream:
    """The caller's stream: an async iterator of chunk dicts, public ids only."""

    __slots__ = (
        "_cleanup",
        "_group",
        "_ids",
        "_leg",
        "_next",
        "_output",
        "_pump",
        "_request",
        "_scope",
        "_stall_timeout",
        "_state",
    )

    def __init__(
        self,
        cleanup: EngineCleanup,
        group: CleanupGroup,
        request: EngineRequest,
        pump: EnginePump | None,
        leg: PrefillLeg | None,
        ids: PublicIds,
        output: OutputMode,
        scope: trio.CancelScope,
        stall_timeout: float,
    ) -> None:
        #: The worker's: who stops the request at the engine, and who owns its tasks.
        self._cleanup = cleanup
        self._group = group
        self._request = request
        self._pump = pump
        self._leg = leg
        # Bound once: the pull is the hot path (one call per token).
        self._next = request.stream.__anext__ if pump is None else pump.receive
        self._stall_timeout = None if stall_timeout == math.inf else stall_timeout
        self._ids = ids
        self._output: OutputMode = output
        self._scope = scope
        self._state = _NEW

    @property
    def id(self) -> str:
        """The request's public id (text chunks carry it)."""
        return self._ids.request

    @property
    def closed(self) -> bool:
        return self._state is _FINISHED or self._state is _CLOSED

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._state is _NEW:
            # A stream whose context was stopped before its first pull must
            # not touch the engine at all.
            await trio.lowlevel.checkpoint_if_cancelled()
            # The engine side beside the caller's pulls: the prefill leg, the reader.
            if self._leg is not None:
                self._group.start_soon(self._leg.run)
            if self._pump is not None:
                self._pump.start(self._group)
        elif self._state is not _OPEN:
            raise StopAsyncIteration
        self._state = _PULLING
        try:
            if self._stall_timeout is None:
                out = await self._next()
            else:
                out = await self._pull_within_stall_timeout(self._stall_timeout)
        except StopAsyncIteration:
            self._state = _FINISHED
            raise
        except BaseException as exc:
            # Cancelled, failed or interrupted: the engine stream cannot
            # resume, so its cleanup starts now, not at block exit.
            failed = isinstance(exc, Exception) and not isinstance(
                exc, EngineError | EngineShutdown
            )
            error = self._cleanup.failed(self._request, exc) if failed else None
            self._close(pull_cancelled=isinstance(exc, trio.Cancelled))
            if error is not None:
                raise error from exc
            raise
        self._state = _OPEN
        return format_chunk(self._output, out, self._ids)

    async def _pull_within_stall_timeout(self, stall_timeout: float) -> dict[str, Any]:
        with trio.move_on_after(stall_timeout):
            return await self._next()
        raise self._cleanup.stalled(self._request)

    async def aclose(self) -> None:
        """End the stream now; the engine-side cleanup goes on in the worker."""
        if self._state is _PULLING:
            # Another task is inside a pull: ending the block is the only way
            # to stop it at once (the pull itself then closes the stream).
            self._scope.cancel()
        else:
            self._close()
        await trio.lowlevel.checkpoint()

    def _close(self, *, pull_cancelled: bool = False) -> None:
        """Hand the engine side over to the worker's cleanup; a no-op once done.

        Both legs stop here, when the stream closes (a cancelled pull closes
        it while the block may stay open for long), not at block exit.
        """
        state = self._state
        if state is _FINISHED or state is _CLOSED:
            return
        self._state = _CLOSED
        if state is _NEW:
            return
        if self._leg is not None:
            self._leg.end()
        if self._pump is not None:
            self._pump.consumer_left()
        else:
            self._cleanup.hand_over(self._request, pull_cancelled=pull_cancelled)


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request one worker has checked; see ``Worker.prepare``."""

    #: The request as the worker runs it: its body, children, ``n``, output mode.
    parsed: ParsedRequest
    #: Whether it runs a prefill leg at the worker's prefill peer (a decode worker's).
    prefill_leg: bool
    worker: Worker

    def check_for(self, worker: Worker, output: OutputMode) -> None:
        """Refuse it to another worker (whose engine honours other fields), or another output."""
        if worker is not self.worker:
            raise InvalidRequest("this request was prepared by another worker")
        if output != self.parsed.output:
            raise InvalidRequest(
                f"this request was prepared for output {self.parsed.output!r}, not {output!r}"
            )


class Worker:
    """Runs generation requests against one engine; see ``open_worker``."""

    def __init__(
        self,
        engine: Engine,
        policy: AbortPolicy,
        cleanups: CleanupGroup,
        observer: WorkerObserver | None = None,
        prefill: PrefillPeer | None = None,
        prefill_cancel_anytime: bool = False,
    ) -> None:
        self._engine = engine
        self._policy = policy
        self._cleanups = cleanups
        self._features = engine.features()
        self._prefill = prefill
        self._prefill_cancel_anytime = prefill_cancel_anytime
        self._faults = FaultLog(None if observer is None else observer.engine_fault)
        self._engine_cleanup = EngineCleanup(engine, policy, cleanups, self._faults, observer)
        #: The streams whose ``generate`` block is open; closed by the shutdown.
        self._streams: Drain[ResponseStream] = Drain()

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def policy(self) -> AbortPolicy:
        return self._policy

    @property
    def features(self) -> EngineFeatures:
        """What the engine detected, as the worker read it at its start."""
        return self._features

    @property
    def role(self) -> Role:
        return self._features.role

    @property
    def open_streams(self) -> int:
        """Streams whose ``generate`` block has not exited yet."""
        return len(self._streams)

    @property
    def pending_cleanups(self) -> int:
        """Requests whose engine-side cleanup is still running."""
        return self._engine_cleanup.pending

    async def wait_idle(self) -> None:
        """Return once no engine-side task is running (at once if none is)."""
        await self._cleanups.wait_idle()

    def capabilities(self) -> dict[str, Any]:
        """Versioned capability metadata, derived from what the engine detected."""
        return build_capabilities(self._features)

    def prepare(
        self,
        request: Mapping[str, Any],
        output: OutputMode = "text",
        *,
        names: Mapping[str, str] | None = None,
    ) -> PreparedRequest:
        """Check ``request`` for this worker, once: ``InvalidRequest`` before anything runs.

        ``generate`` takes what this returns in place of the request, so that a
        server which sizes its answer by the request (``parsed.children``)
        reads it as the worker does, and checks it only once. ``names`` maps a
        native field (``sampling_params.min_new_tokens``) to the caller's name
        for it (``min_tokens``): a refusal of a field names it in the caller's words.
        """
        return PreparedRequest(*self._check(request, output, names or {}), self)

    def _check(
        self, request: Mapping[str, Any], output: OutputMode, names: Mapping[str, str]
    ) -> tuple[ParsedRequest, bool]:
        """The request parsed and checked for this worker; whether it runs a prefill leg."""
        parsed = parse_request(request, output)
        check_honoured(parsed.body, self._features, names)
        if (
            parsed.batch_size is not None
            and parsed.n > 1
            and not self._features.batch_parallel_sampling
        ):
            raise InvalidRequest(
                "this engine cannot run parallel sampling (n > 1) on a native batch; "
                "send one prompt per request"
            )
        return parsed, needs_prefill_leg(self.role, parsed, self._prefill)

    def generate(
        self,
        request: Mapping[str, Any] | PreparedRequest,
        ctx: RequestContext,
        output: OutputMode = "text",
    ) -> Generation:
        """Stream one request's chunks: ``async with worker.generate(...) as chunks``.

        Leaving the block by any path stops the request. ``request`` is an
        SGLang ``/generate`` body, or what ``prepare`` made of one (for the
        same ``output``). Entering the block raises ``InvalidRequest`` before
        anything reaches the engine, and ``EngineShutdown`` if the worker is
        shutting down; leaving it raises ``EngineShutdown`` if the worker shut
        down while it was open. ``ctx.stop()``/``ctx.kill()`` cancel the
        block's body (like an expired ``move_on_after``) and the block exits
        normally.
        """
        return Generation(self, request, ctx, output)

    def _open(
        self,
        request: Mapping[str, Any] | PreparedRequest,
        ctx: RequestContext,
        output: OutputMode,
    ) -> ResponseStream:
        """The block's start: the request checked, its stream made, its scope bound to ``ctx``."""
        if isinstance(request, PreparedRequest):
            request.check_for(self, output)
            parsed, prefill_leg = request.parsed, request.prefill_leg
        else:
            parsed, prefill_leg = self._check(request, output, {})
        if not isinstance(ctx, RequestContext):
            raise InvalidRequest(f"ctx must be a RequestContext, got {type(ctx).__name__}")
        bootstrap = None
        if prefill_leg:
            assert self._prefill is not None  # a prefill leg needs the worker's peer
            bootstrap = new_bootstrap(self._prefill)
        if self._streams.closed:
            raise EngineShutdown("the worker is shutting down")
        # One minted rid, or one per prompt for a batch: all 32 hex digits,
        # so none is a prefix of another (SGLang aborts by prefix).
        rids = tuple(mint_rid() for _ in range(parsed.rid_count))
        ids = PublicIds.for_request(parsed, ctx.id)
        engine_request = EngineRequest(
            self._engine.generate({**parsed.engine_request(rids), **(bootstrap or {})}),
            ids.request,
            rids if parsed.stable_ids else (),
        )
        release_on_close = self._features.release_on_close
        pump = None
        if not (parsed.stable_ids and release_on_close):
            pump = EnginePump(
                engine_request,
                self._engine_cleanup,
                self._policy,
                release_on_close=release_on_close,
                children_unknown=not parsed.stable_ids,
            )
        scope = trio.CancelScope()
        leg = None
        if bootstrap is not None:
            assert self._prefill is not None
            leg = PrefillLeg(
                self._prefill,
                {**parsed.body, **bootstrap},
                ids.request,
                rids,
                scope,
                self._faults,
                cancel_anytime=self._prefill_cancel_anytime,
                cleanup_timeout=self._policy.cleanup_timeout,
            )
        stream = ResponseStream(
            self._engine_cleanup,
            self._cleanups,
            engine_request,
            pump,
            leg,
            ids,
            parsed.output,
            scope,
            self._policy.stall_timeout,
        )
        self._streams.add(stream)
        attach(ctx, scope)
        return stream

    def _close_block(self, stream: ResponseStream, ctx: RequestContext) -> None:
        """The block's end, however it ends: the stream closed, both legs stopped."""
        detach(ctx, stream._scope)
        stream._close()
        if stream._leg is not None:  # again: a stream that finished leaves its leg to this
            stream._leg.end()
        self._streams.discard(stream)

    def _block_error(self, stream: ResponseStream) -> Exception | None:
        """What leaving a block that ended without an error of its own raises, if anything."""
        leg = stream._leg
        if leg is not None and leg.error is not None:
            error = EngineError(f"the prefill of {stream.id} failed ({type(leg.error).__name__})")
            error.__cause__ = leg.error
            return error
        if self._streams.closed and stream._scope.cancelled_caught:
            return EngineShutdown("the worker shut down while the stream was open")
        return None

    # -- shutdown ------------------------------------------------------------

    def end_grace(self) -> None:
        """Cut the shutdown grace short, as a second signal asks; idempotent.

        Open streams are no longer waited for and pending cleanup is cancelled
        at once (now, or as soon as the shutdown begins); the engine still
        closes after, which stops whatever it still runs.
        """
        self._streams.hurry()
        if self._streams.closed:  # the shutdown has begun
            self._cleanups.close(trio.current_time())

    async def _shutdown(self) -> None:
        """End open streams; give them and the cleanup the grace as one deadline."""
        deadline = trio.current_time() + self._policy.shutdown_grace
        self._streams.close()
        for stream in self._streams:
            stream._scope.cancel()
        # Their callers hand the engine side over as their blocks exit.
        with trio.CancelScope(shield=True):
            await self._streams.wait(deadline)
        self._cleanups.close(trio.current_time() if self._streams.hurried else deadline)


class Generation:
    """One request's block, from ``async with worker.generate(...)`` to its exit.

    A class, not an ``asynccontextmanager``: that costs four tracked objects
    a request (the async generator, its manager, trio's weak reference to the
    generator, a bound method) where this costs one, and the collector's
    passes over a burst of 10,000 cancels pay for each.
    """

    __slots__ = ("_ctx", "_output", "_request", "_stream", "_worker")

    def __init__(
        self,
        worker: Worker,
        request: Mapping[str, Any] | PreparedRequest,
        ctx: RequestContext,
        output: OutputMode,
    ) -> None:
        self._worker = worker
        self._request = request
        self._ctx = ctx
        self._output = output
        self._stream: ResponseStream | None = None

    async def __aenter__(self) -> ResponseStream:
        if self._stream is not None:
            raise RuntimeError("a generate() block is entered once")
        stream = self._stream = self._worker._open(self._request, self._ctx, self._output)
        stream._scope.__enter__()
        return stream

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        stream = self._stream
        assert stream is not None  # set by ``__aenter__``
        try:
            swallowed = stream._scope.__exit__(exc_type, exc, traceback)
        finally:
            self._worker._close_block(stream, self._ctx)
        if exc is not None and not swallowed:
            return False  # the body's own error goes on
        error = self._worker._block_error(stream)
        if error is not None:
            raise error from error.__cause__  # the prefill's failure, or nothing
        return swallowed


@asynccontextmanager
async def open_worker(
    engine: Engine,
    *,
    policy: AbortPolicy | None = None,
    observer: WorkerObserver | None = None,
    prefill: PrefillPeer | None = None,
) -> AsyncIterator[Worker]:
    """Run ``engine`` and a worker over it for the life of the block.

    ``observer``, if given, hears how each engine-side cleanup went (metrics).
    ``prefill``, for an engine in decode mode, is the prefill worker that
    runs the prefill legs of requests that come without bootstrap fields
    (see ``_disagg.py``); it must answer with its capabilities at start-up
    (``PrefillFailed`` otherwise).

    On exit, open streams get ``EngineShutdown``, pending cleanup gets
    ``policy.shutdown_grace`` seconds and is then cancelled, and only after
    that does the engine close. Shutdown takes at most the grace plus the time
    cancelled cleanup needs to finish a stream close already in progress
    (``policy.close_timeout``), plus the engine's close, itself bounded by
    ``policy.engine_close_timeout``. ``Worker.end_grace()`` cuts the grace
    short.
    """
    policy = AbortPolicy() if policy is None else policy
    if not isinstance(policy, AbortPolicy):
        raise TypeError(f"policy must be an AbortPolicy, got {type(policy).__name__}")
    if prefill is not None and engine.features().role != "decode":
        raise ValueError("prefill= is for a worker whose engine is in decode mode")
    leaving_with: BaseException | None = None
    with trio.CancelScope() as closing:
        async with engine.running():
            try:
                cancel_anytime = prefill is not None and await peer_cancels_anytime(prefill)
                async with open_cleanup_group() as cleanups:
                    worker = Worker(engine, policy, cleanups, observer, prefill, cancel_anytime)
                    try:
                        yield worker
                    finally:
                        await worker._shutdown()
                cut = worker._engine_cleanup.cut_at_close
                if cut:
                    logger.warning(
                        "%d engine-side cleanups were still running after the %ss shutdown "
                        "grace and were cancelled; the engine closes with them",
                        cut,
                        policy.shutdown_grace,
                    )
            finally:
                # From here on the engine closes; bounded, so that leaving the
                # worker always finishes.
                closing.deadline = trio.current_time() + policy.engine_close_timeout
                leaving_with = sys.exception()
    if closing.cancelled_caught:
        logger.error(
            "the engine did not close within %ss (engine_close_timeout); left it behind",
            policy.engine_close_timeout,
        )
        if leaving_with is not None:
            # The close's cancellation replaced what the block was raising: not lost.
            raise leaving_with
