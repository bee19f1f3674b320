"""The cancellation lifecycle: ``open_worker`` and ``Worker.generate``.

The shape follows hypercorn's trio worker: the engine is entered first, the
cleanup nursery is opened after it and closed before it, and leaving the
worker gives pending cleanup a grace period, then cancels it, and only then
lets the engine close.

Why the caller's stream can close at once: the consumer's block runs inside a
cancel scope that ``ctx.stop()``/``ctx.kill()`` and the worker's shutdown
cancel. A cancelled pull runs the engine's own release path (an undispatched
request is forgotten and never reaches the scheduler, a dispatched one is
aborted after its dispatch), and whatever still has to be awaited (closing
the stream, confirming the abort took, the ordered fallback) runs in a
detached task of the worker's nursery, each bounded by ``AbortPolicy``.
Requests whose engine ids are known in advance (one prompt, or a native
batch) on an engine whose close releases them are read directly by the
caller's task; the others are read by an ``EnginePump`` (see ``_pump.py``).
A decode worker's request that needs its prefill run elsewhere also has a
``PrefillLeg`` (see ``_disagg.py``), started with the first pull and stopped
when the block ends.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

from ._capabilities import build_capabilities
from ._cleanup import EngineCleanup, EngineRequest
from ._context import RequestContext
from ._disagg import CANCEL_ANYTIME, PrefillLeg, PrefillPeer, bootstrap_fields, role_of
from ._engine import Engine
from ._errors import EngineError, EngineShutdown, InvalidRequest
from ._faults import FaultLog
from ._ids import mint_rid
from ._observer import WorkerObserver
from ._outputs import PublicIds, format_chunk
from ._policy import AbortPolicy
from ._pump import EnginePump
from ._request import OutputMode, parse_request

__all__ = ["ResponseStream", "Worker", "open_worker"]

logger = logging.getLogger("trio_sglang")


class ResponseStream:
    """The caller's stream: an async iterator of chunk dicts, public ids only."""

    __slots__ = (
        "_closed",
        "_exhausted",
        "_ids",
        "_leg",
        "_next",
        "_output",
        "_pulling",
        "_pump",
        "_request",
        "_scope",
        "_shutdown",
        "_stall_timeout",
        "_started",
        "_worker",
    )

    def __init__(
        self,
        worker: Worker,
        request: EngineRequest,
        pump: EnginePump | None,
        ids: PublicIds,
        output: OutputMode,
        scope: trio.CancelScope,
        leg: PrefillLeg | None,
    ) -> None:
        self._worker = worker
        self._request = request
        self._pump = pump
        self._leg = leg
        # Bound once: the pull is the hot path (one call per token).
        self._next = request.stream.__anext__ if pump is None else pump.receive
        stall_timeout = worker.policy.stall_timeout
        self._stall_timeout = None if stall_timeout == math.inf else stall_timeout
        self._ids = ids
        self._output: OutputMode = output
        self._scope = scope
        self._started = False
        self._pulling = False
        self._closed = False
        self._exhausted = False
        self._shutdown = False

    @property
    def id(self) -> str:
        """The request's public id (text chunks carry it)."""
        return self._ids.request

    @property
    def closed(self) -> bool:
        return self._closed

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._closed:
            raise StopAsyncIteration
        if not self._started:
            # A stream whose context was stopped before its first pull must
            # not touch the engine at all.
            await trio.lowlevel.checkpoint_if_cancelled()
            self._started = True
            if self._leg is not None:
                self._worker._start_prefill_leg(self._leg)
            if self._pump is not None:
                self._worker._start_pump(self._pump)
        self._pulling = True
        pulled = pull_cancelled = False
        try:
            if self._stall_timeout is None:
                out = await self._next()
            else:
                out = await self._pull_within_stall_timeout(self._stall_timeout)
            pulled = True
        except StopAsyncIteration:
            self._exhausted = True
            raise
        except (EngineError, EngineShutdown):
            raise
        except trio.Cancelled:
            pull_cancelled = True
            raise
        except Exception as exc:
            raise self._worker._engine_failed(self._request, exc) from exc
        finally:
            self._pulling = False
            if not pulled:
                # Cancelled, failed or exhausted: the engine stream cannot
                # resume, so its cleanup starts now, not at block exit.
                self._close(pull_cancelled=pull_cancelled)
        return format_chunk(self._output, out, self._ids)

    async def _pull_within_stall_timeout(self, stall_timeout: float) -> dict[str, Any]:
        with trio.move_on_after(stall_timeout):
            return await self._next()
        raise self._worker._engine_stalled(self._request)

    async def aclose(self) -> None:
        """End the stream now; the engine-side cleanup goes on in the worker."""
        if self._pulling:
            # Another task is inside a pull: ending the block is the only way
            # to stop it at once (the pull itself then closes the stream).
            self._scope.cancel()
        else:
            self._close()
        await trio.lowlevel.checkpoint()

    def _close(self, *, pull_cancelled: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        if self._pump is not None:
            self._pump.consumer_left()
        elif not self._exhausted:
            self._worker._hand_over(self._request, pull_cancelled=pull_cancelled)

    def _end_for_shutdown(self) -> None:
        self._shutdown = True
        self._scope.cancel()


class Worker:
    """Runs generation requests against one engine; see ``open_worker``."""

    def __init__(
        self,
        engine: Engine,
        policy: AbortPolicy,
        nursery: trio.Nursery,
        observer: WorkerObserver | None = None,
        prefill: PrefillPeer | None = None,
        prefill_cancel_anytime: bool = False,
    ) -> None:
        self._engine = engine
        self._policy = policy
        self._observer = observer
        self._nursery = nursery
        self._features = dict(engine.features())
        self._role = role_of(self._features)
        self._prefill = prefill
        self._prefill_cancel_anytime = prefill_cancel_anytime
        self._prefill_legs: set[PrefillLeg] = set()
        self._faults = FaultLog(observer)
        self._engine_cleanup = EngineCleanup(engine, policy, self._faults)
        self._open: set[ResponseStream] = set()
        self._cleanups: set[trio.CancelScope] = set()
        self._pending_cleanups = 0
        self._closing = False
        self._cancel_cleanups = False
        self._nursery_closed = False
        self._cancelled_at_shutdown = 0
        self._quiet: trio.Event | None = None

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def policy(self) -> AbortPolicy:
        return self._policy

    @property
    def open_streams(self) -> int:
        """Streams whose ``generate`` block has not exited yet."""
        return len(self._open)

    @property
    def pending_cleanups(self) -> int:
        """Requests whose engine-side cleanup is still running."""
        return self._pending_cleanups

    def capabilities(self) -> dict[str, Any]:
        """Versioned capability metadata, derived from what the engine detected."""
        return build_capabilities(self._features)

    @asynccontextmanager
    async def generate(
        self, request: Mapping[str, Any], ctx: RequestContext, output: OutputMode = "text"
    ) -> AsyncIterator[ResponseStream]:
        """Stream one request's chunks; leaving the block by any path stops it.

        Raises ``InvalidRequest`` before anything reaches the engine, and
        ``EngineShutdown`` if the worker is shutting down or shuts down while
        the block is open. ``ctx.stop()``/``ctx.kill()`` cancel the block's
        body (like an expired ``move_on_after``) and the block exits normally.
        """
        parsed = parse_request(request, output)
        if not isinstance(ctx, RequestContext):
            raise InvalidRequest(f"ctx must be a RequestContext, got {type(ctx).__name__}")
        if (
            parsed.batch_size is not None
            and parsed.n > 1
            and self._features.get("batch_parallel_sampling") is not True
        ):
            raise InvalidRequest(
                "this engine cannot run parallel sampling (n > 1) on a native batch; "
                "send one prompt per request"
            )
        bootstrap = bootstrap_fields(self._role, parsed, self._prefill)
        if self._closing:
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
        release_on_close = self._features.get("release_on_close") is True
        pump = (
            None
            if parsed.stable_ids and release_on_close
            else EnginePump(
                self,
                engine_request,
                self._engine_cleanup,
                self._policy,
                release_on_close=release_on_close,
                children_unknown=not parsed.stable_ids,
            )
        )
        scope = trio.CancelScope()
        leg = None
        if bootstrap is not None and self._prefill is not None:
            leg = PrefillLeg(
                self._prefill, {**parsed.body, **bootstrap}, ids.request, rids, scope, self._faults
            )
        stream = ResponseStream(self, engine_request, pump, ids, parsed.output, scope, leg)
        self._open.add(stream)
        ctx._attach(scope)
        try:
            with scope:
                yield stream
        finally:
            ctx._detach(scope)
            self._open.discard(stream)
            stream._close()
            if leg is not None:
                self._end_prefill_leg(leg)
            self._maybe_quiet()
        if leg is not None and leg.error is not None:
            raise EngineError(
                f"the prefill of {ids.request} failed ({type(leg.error).__name__})"
            ) from leg.error
        if stream._shutdown and scope.cancelled_caught:
            raise EngineShutdown("the worker shut down while the stream was open") from None

    # -- engine-side work, owned by the worker's nursery ----------------------

    def _start_pump(self, pump: EnginePump) -> None:
        if self._nursery_closed:
            raise EngineShutdown("the worker has shut down")
        self._nursery.start_soon(pump.run)

    def _start_prefill_leg(self, leg: PrefillLeg) -> None:
        if self._nursery_closed:
            raise EngineShutdown("the worker has shut down")
        self._prefill_legs.add(leg)
        self._nursery.start_soon(self._run_prefill_leg, leg)

    async def _run_prefill_leg(self, leg: PrefillLeg) -> None:
        try:
            await leg.run()
        finally:
            self._prefill_legs.discard(leg)
            self._maybe_quiet()

    def _end_prefill_leg(self, leg: PrefillLeg) -> None:
        """The request is over: stop its prefill leg, or bound it if the peer cannot stop."""
        leg.request_ended()
        if self._prefill_cancel_anytime or self._cancel_cleanups:
            leg.scope.cancel()
        else:
            leg.scope.deadline = min(
                leg.scope.deadline, trio.current_time() + self._policy.cleanup_timeout
            )

    def _hand_over(self, request: EngineRequest, *, pull_cancelled: bool) -> None:
        """Start the cleanup of a request whose caller has gone, unless it is already done.

        A cancelled pull ran the engine's release path; if the engine then
        holds none of the request's ids, there is nothing left to await (the
        usual case, and in a burst of cancels it spares a task per request).
        """
        if pull_cancelled and not request.held_by(self._engine):
            if self._observer is not None:
                self._observer.cleanup_finished(0.0, released=True)
            return
        if self._nursery_closed:
            logger.warning(
                "request %s ended after the worker closed; the engine closed with it",
                request.public_id,
            )
            return
        self._begin_cleanup(request)
        self._nursery.start_soon(self._run_cleanup, request)

    def _begin_cleanup(self, request: EngineRequest) -> None:
        """Count a cleanup from the moment it is owed, before its task runs."""
        request.cancelled_at = trio.current_time()
        self._pending_cleanups += 1

    def _guard_cleanup(self, scope: trio.CancelScope) -> None:
        """Shield a cleanup from whoever cancels the worker's body, and bound it.

        Only its deadline or the worker's own shutdown (after the grace) ends it.
        """
        scope.shield = True
        scope.deadline = min(scope.deadline, trio.current_time() + self._policy.cleanup_timeout)
        self._cleanups.add(scope)
        if self._cancel_cleanups:
            scope.cancel()

    def _end_cleanup(self, scope: trio.CancelScope, request: EngineRequest) -> None:
        self._cleanups.discard(scope)
        self._pending_cleanups -= 1
        if self._observer is not None and request.cancelled_at is not None:
            self._observer.cleanup_finished(
                trio.current_time() - request.cancelled_at,
                released=not request.held_by(self._engine),
            )
        self._maybe_quiet()

    def _log_unfinished_cleanup(self, request: EngineRequest, scope: trio.CancelScope) -> None:
        if self._cancel_cleanups:
            # One summary at worker exit, not a line per request in a burst.
            self._cancelled_at_shutdown += 1
            logger.debug("cleanup of request %s cancelled at shutdown", request.public_id)
            return
        self._faults.report(
            "cleanup_timeout",
            request.public_id,
            request.unfinished(),
            f"the cleanup ran past {self._policy.cleanup_timeout}s; the engine may still hold it",
            level=logging.WARNING,
        )

    # -- engine faults seen by the caller -------------------------------------

    def _engine_failed(self, request: EngineRequest, error: Exception) -> EngineError:
        self._faults.report(
            "stream_error", request.public_id, request.unfinished(), repr(error), error=error
        )
        # The engine's own error may name internal ids: the caller gets its
        # type (and ``__cause__``), the log gets the whole of it.
        return EngineError(
            f"the engine failed while generating {request.public_id} ({type(error).__name__})"
        )

    def _engine_stalled(self, request: EngineRequest) -> EngineError:
        timeout = self._policy.stall_timeout
        phases = ", ".join(self._engine.phase(rid).value for rid in request.unfinished())
        self._faults.report(
            "stream_stalled",
            request.public_id,
            request.unfinished(),
            f"no output for {timeout}s (engine phase: {phases or 'unknown'})",
        )
        return EngineError(f"the engine sent no output for {request.public_id} in {timeout}s")

    async def _run_cleanup(self, request: EngineRequest) -> None:
        """One request's engine-side cleanup, counted by ``_hand_over``."""
        with trio.CancelScope() as scope:
            self._guard_cleanup(scope)
            try:
                await self._engine_cleanup.stop(request)
            finally:
                self._end_cleanup(scope, request)
        if scope.cancelled_caught:
            self._log_unfinished_cleanup(request, scope)

    # -- shutdown ------------------------------------------------------------

    def _maybe_quiet(self) -> None:
        if (
            self._quiet is not None
            and not self._open
            and not self._pending_cleanups
            and not self._prefill_legs
        ):
            self._quiet.set()

    async def _shutdown(self) -> None:
        """End open streams, give cleanup the grace, then cancel what is left."""
        self._closing = True
        self._quiet = trio.Event()
        for stream in list(self._open):
            stream._end_for_shutdown()
        self._maybe_quiet()
        with trio.move_on_after(self._policy.shutdown_grace, shield=True):
            await self._quiet.wait()
        self._cancel_cleanups = True
        for scope in self._cleanups:
            scope.cancel()
        for leg in self._prefill_legs:
            leg.scope.cancel()


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
    (see ``_disagg.py``).

    On exit, open streams get ``EngineShutdown``, pending cleanup gets
    ``policy.shutdown_grace`` seconds and is then cancelled, and only after
    that does the engine close. Shutdown takes at most the grace plus the time
    cancelled cleanup needs to finish a stream close already in progress
    (``policy.close_timeout``).
    """
    policy = AbortPolicy() if policy is None else policy
    if not isinstance(policy, AbortPolicy):
        raise TypeError(f"policy must be an AbortPolicy, got {type(policy).__name__}")
    if prefill is not None and role_of(engine.features()) != "decode":
        raise ValueError("prefill= is for a worker whose engine is in decode mode")
    async with engine.running():
        cancel_anytime = prefill is not None and await _cancels_anytime(prefill, policy)
        async with trio.open_nursery() as nursery:
            worker = Worker(engine, policy, nursery, observer, prefill, cancel_anytime)
            try:
                yield worker
            finally:
                await worker._shutdown()
                # From here on the nursery may close at any schedule point; a
                # stream that ends later finds the worker closed.
                worker._nursery_closed = True
        if worker._cancelled_at_shutdown:
            logger.warning(
                "%d engine-side cleanups were still running after the %ss shutdown grace "
                "and were cancelled; the engine closes with them",
                worker._cancelled_at_shutdown,
                policy.shutdown_grace,
            )


async def _cancels_anytime(peer: PrefillPeer, policy: AbortPolicy) -> bool:
    """Whether ``peer`` advertises that a cancel stops its prefill in any queue."""
    with trio.fail_after(policy.dispatch_timeout):
        capabilities = await peer.capabilities()
    features = capabilities.get("features")
    if isinstance(features, Mapping) and features.get(CANCEL_ANYTIME) is True:
        return True
    logger.warning(
        "prefill worker %s does not advertise %s: cancels are not sent to it, and the "
        "prefill of a cancelled request runs to its end there (bounded by cleanup_timeout)",
        peer.name,
        CANCEL_ANYTIME,
    )
    return False
