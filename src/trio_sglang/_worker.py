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
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

from ._capabilities import build_capabilities
from ._context import RequestContext
from ._engine import Engine, EngineStream, RequestPhase
from ._errors import EngineShutdown, InvalidRequest
from ._ids import mint_rid
from ._outputs import format_chunk
from ._policy import AbortPolicy
from ._request import OutputMode, parse_request

__all__ = ["ResponseStream", "Worker", "open_worker"]

logger = logging.getLogger("trio_sglang")


class ResponseStream:
    """The caller's stream: an async iterator of chunk dicts, public ids only."""

    __slots__ = (
        "_closed",
        "_engine_stream",
        "_exhausted",
        "_output",
        "_public_id",
        "_pulling",
        "_rid",
        "_scope",
        "_shutdown",
        "_started",
        "_worker",
    )

    def __init__(
        self,
        worker: Worker,
        engine_stream: EngineStream,
        rid: str,
        public_id: str,
        output: OutputMode,
        scope: trio.CancelScope,
    ) -> None:
        self._worker = worker
        self._engine_stream = engine_stream
        self._rid = rid
        self._public_id = public_id
        self._output: OutputMode = output
        self._scope = scope
        self._started = False
        self._pulling = False
        self._closed = False
        self._exhausted = False
        self._shutdown = False

    @property
    def id(self) -> str:
        """The public id this stream's chunks carry."""
        return self._public_id

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
        self._pulling = True
        pulled = False
        try:
            out = await self._engine_stream.__anext__()
            pulled = True
        except StopAsyncIteration:
            self._exhausted = True
            raise
        finally:
            self._pulling = False
            if not pulled:
                # Cancelled, failed or exhausted: the engine stream cannot
                # resume, so its cleanup starts now, not at block exit.
                self._close()
        return format_chunk(self._output, out, self._public_id)

    async def aclose(self) -> None:
        """End the stream now; the engine-side cleanup goes on in the worker."""
        if self._pulling:
            # Another task is inside a pull: ending the block is the only way
            # to stop it at once (the pull itself then closes the stream).
            self._scope.cancel()
        else:
            self._close()
        await trio.lowlevel.checkpoint()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._started and not self._exhausted:
                self._worker._hand_over(self._engine_stream, self._rid, self._public_id)

    def _end_for_shutdown(self) -> None:
        self._shutdown = True
        self._scope.cancel()


class Worker:
    """Runs generation requests against one engine; see ``open_worker``."""

    def __init__(self, engine: Engine, policy: AbortPolicy, nursery: trio.Nursery) -> None:
        self._engine = engine
        self._policy = policy
        self._nursery = nursery
        self._open: set[ResponseStream] = set()
        self._cleanups: set[trio.CancelScope] = set()
        self._pending_cleanups = 0
        self._closing = False
        self._cancel_cleanups = False
        self._nursery_closed = False
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
        """Detached engine-side cleanup tasks still running."""
        return self._pending_cleanups

    def capabilities(self) -> dict[str, Any]:
        """Versioned capability metadata, derived from what the engine detected."""
        return build_capabilities(self._engine.features())

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
        if not parsed.single_sample:
            raise InvalidRequest(
                "parallel sampling (n > 1) and native batches are not supported by this "
                "version of the lifecycle; send one prompt with n = 1"
            )
        if not isinstance(ctx, RequestContext):
            raise InvalidRequest(f"ctx must be a RequestContext, got {type(ctx).__name__}")
        if self._closing:
            raise EngineShutdown("the worker is shutting down")
        rid = mint_rid()
        public_id = parsed.caller_rid if isinstance(parsed.caller_rid, str) else ctx.id
        scope = trio.CancelScope()
        stream = ResponseStream(
            self,
            self._engine.generate(parsed.engine_request(rid)),
            rid,
            public_id,
            parsed.output,
            scope,
        )
        self._open.add(stream)
        ctx._attach(scope)
        try:
            with scope:
                yield stream
        finally:
            ctx._detach(scope)
            self._open.discard(stream)
            stream._close()
            self._maybe_quiet()
        if stream._shutdown and scope.cancelled_caught:
            raise EngineShutdown("the worker shut down while the stream was open") from None

    # -- engine-side cleanup, detached ---------------------------------------

    def _hand_over(self, engine_stream: EngineStream, rid: str, public_id: str) -> None:
        if self._nursery_closed:
            logger.warning(
                "request %s (rid %s) ended after the worker closed; the engine closed with it",
                public_id,
                rid,
            )
            return
        self._pending_cleanups += 1
        self._nursery.start_soon(
            self._cleanup, engine_stream, rid, public_id, name=f"cleanup-{rid}"
        )

    async def _cleanup(self, engine_stream: EngineStream, rid: str, public_id: str) -> None:
        # Shielded from whoever cancels the worker's body: only the worker's
        # own shutdown (after the grace) or the deadline ends a cleanup.
        with trio.move_on_after(self._policy.cleanup_timeout, shield=True) as scope:
            self._cleanups.add(scope)
            if self._cancel_cleanups:
                scope.cancel()
            try:
                await self._stop_at_engine(engine_stream, rid, public_id)
            finally:
                self._cleanups.discard(scope)
                self._pending_cleanups -= 1
                self._maybe_quiet()
        if scope.cancelled_caught:
            why = "cancelled at shutdown" if self._cancel_cleanups else "timed out"
            logger.warning(
                "cleanup of request %s (rid %s) %s; the engine may still hold it",
                public_id,
                rid,
                why,
            )

    async def _stop_at_engine(self, engine_stream: EngineStream, rid: str, public_id: str) -> None:
        policy = self._policy
        # Closing runs the engine's own release path. Shielded even from the
        # shutdown: a half-closed stream is worse than a short wait.
        with trio.move_on_after(policy.close_timeout, shield=True) as close_scope:
            try:
                await engine_stream.aclose()
            except Exception:
                logger.exception("closing the engine stream of %s (rid %s) failed", public_id, rid)
        if close_scope.cancelled_caught:
            logger.warning(
                "closing the engine stream of %s (rid %s) took over %ss",
                public_id,
                rid,
                policy.close_timeout,
            )
        if await self._released_in_time(rid):
            return
        await self._ordered_abort(rid, public_id)

    async def _released_in_time(self, rid: str) -> bool:
        """Whether the engine lets go of ``rid`` within ``policy.release_timeout``."""
        with trio.move_on_after(self._policy.release_timeout):
            phase = self._engine.phase(rid)
            while phase is not RequestPhase.ABSENT:
                phase = await self._engine.wait_phase_change(rid, phase)
            return True
        return False

    async def _ordered_abort(self, rid: str, public_id: str) -> None:
        """The fallback when closing did not free the request: abort, but never before dispatch."""
        engine, policy = self._engine, self._policy
        phase = engine.phase(rid)
        if phase is RequestPhase.REGISTERED:
            with trio.move_on_after(policy.dispatch_timeout):
                phase = await engine.wait_phase_change(rid, phase)
            if phase is RequestPhase.REGISTERED:
                logger.error(
                    "request %s (rid %s) still undispatched after %ss; not aborting it, "
                    "since an abort before dispatch is lost",
                    public_id,
                    rid,
                    policy.dispatch_timeout,
                )
                return
        error: Exception | None = None
        for attempt in range(1, policy.abort_attempts + 1):
            if phase is RequestPhase.ABSENT:
                return
            try:
                engine.abort(rid)
            except Exception as exc:
                error = exc
            else:
                if await self._released_in_time(rid):
                    if error is not None:
                        logger.warning(
                            "abort of %s (rid %s) took on attempt %d after an error: %r",
                            public_id,
                            rid,
                            attempt,
                            error,
                        )
                    return
            if attempt < policy.abort_attempts:
                await trio.sleep(policy.abort_retry_delay)
            phase = engine.phase(rid)
        logger.error(
            "the engine still holds request %s (rid %s) after %d abort attempts",
            public_id,
            rid,
            policy.abort_attempts,
            exc_info=error,
        )

    # -- shutdown ------------------------------------------------------------

    def _maybe_quiet(self) -> None:
        if self._quiet is not None and not self._open and not self._pending_cleanups:
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


@asynccontextmanager
async def open_worker(
    engine: Engine, *, policy: AbortPolicy | None = None
) -> AsyncIterator[Worker]:
    """Run ``engine`` and a worker over it for the life of the block.

    On exit, open streams get ``EngineShutdown``, pending cleanup gets
    ``policy.shutdown_grace`` seconds and is then cancelled, and only after
    that does the engine close. Shutdown takes at most the grace plus the time
    cancelled cleanup needs to finish a stream close already in progress
    (``policy.close_timeout``).
    """
    policy = AbortPolicy() if policy is None else policy
    if not isinstance(policy, AbortPolicy):
        raise TypeError(f"policy must be an AbortPolicy, got {type(policy).__name__}")
    async with engine.running():
        worker: Worker | None = None
        try:
            async with trio.open_nursery() as nursery:
                worker = Worker(engine, policy, nursery)
                try:
                    yield worker
                finally:
                    await worker._shutdown()
        finally:
            if worker is not None:
                worker._nursery_closed = True
