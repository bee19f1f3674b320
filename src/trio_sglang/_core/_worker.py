"""The cancellation lifecycle's entry: ``open_worker``, ``Worker.generate`` and the block.

One request's life, top to bottom:

1. ``generate`` checks the request (or takes what ``prepare`` checked), and
   that the engine honours every field it asks for (``InvalidRequest``
   before anything reaches the engine), mints the internal rids, and opens
   the caller's block inside a cancel scope that ``ctx.stop()``/``ctx.kill()``
   and the worker's shutdown cancel.
2. From there one object carries the request: its ``Lifecycle`` (see
   ``_lifecycle.py``), from the first pull to the last cleanup task, with one
   ``State``. The caller's ``ResponseStream`` is a thin view over it.
3. The block ends, however it ends: the request leaves (its cleanup goes on
   in the worker's ``CleanupGroup``, bounded by ``AbortPolicy``, and never
   holds the caller's block open), and a prefill leg ends too.

The shape follows hypercorn's trio worker: the engine is entered first, the
``CleanupGroup`` is opened after it and closed before it, and leaving the
worker ends every open block (its ``Drain``), then gives their cleanup what
is left of the grace as a deadline, and only then lets the engine close.

``Worker`` and ``ResponseStream`` are friends, here in this module: the
block's start and end (``_open``, ``_close_block``, ``_block_error``) are the
worker's, called by the stream as its block is entered and left.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Coroutine, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import trio

from .._engine import Engine, EngineFeatures, Role
from .._errors import EngineError, EngineShutdown, InvalidRequest
from .._request._parse import OutputMode, ParsedRequest, parse_request
from ._capabilities import build_capabilities
from ._cleanup_group import CleanupGroup, open_cleanup_group
from ._context import RequestContext, attach, detach
from ._disagg import PrefillLeg, PrefillPeer, new_bootstrap, peer_cancels_anytime
from ._drain import Drain
from ._lifecycle import Lifecycle
from ._outputs import PublicIds
from ._policy import AbortPolicy
from ._reports import Reports, WorkerObserver
from ._shared import shared_by_worker

__all__ = ["PreparedRequest", "ResponseStream", "Worker", "open_worker"]

logger = logging.getLogger("trio_sglang")


class ResponseStream:
    """The caller's stream: ``async with worker.generate(...) as chunks``, then ``async for``.

    Chunk dicts, with public ids only. A thin view over the request's
    ``Lifecycle``, made when the block is entered: the pulls and the leaving
    are the lifecycle's, the block (its cancel scope, its end) is the worker's.

    One object is both the block and the stream: a request costs the
    collector one tracked object fewer, which a burst of 10,000 cancels feels.
    """

    __slots__ = ("_ctx", "_life", "_output", "_request", "_worker")

    #: Set when the block is entered.
    _life: Lifecycle

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
        self._output: OutputMode = output

    @property
    def id(self) -> str:
        """The request's public id (text chunks carry it)."""
        return self._entered().ids.request

    @property
    def closed(self) -> bool:
        return self._entered().closed

    def __aiter__(self) -> ResponseStream:
        return self

    def __anext__(self) -> Coroutine[Any, Any, dict[str, Any]]:
        # The lifecycle's own coroutine: a view adds no frame to the pull, the hot path.
        try:
            life = self._life
        except AttributeError:
            raise _not_entered() from None
        return life.pull()

    async def aclose(self) -> None:
        """End the stream now; the engine-side cleanup goes on in the worker."""
        life = self._entered()
        if life.pulling:
            # Another task is inside a pull: ending the block is the only way
            # to stop it at once (the pull itself then leaves).
            life.scope.cancel()
        else:
            life.leave()
        await trio.lowlevel.checkpoint()

    def _entered(self) -> Lifecycle:
        try:
            return self._life
        except AttributeError:
            raise _not_entered() from None

    async def __aenter__(self) -> ResponseStream:
        if hasattr(self, "_life"):
            raise RuntimeError("a generate() block is entered once")
        life = self._life = self._worker._open(self._request, self._ctx, self._output)
        life.scope.__enter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        life = self._life
        try:
            swallowed = life.scope.__exit__(exc_type, exc, traceback)
        finally:
            self._worker._close_block(life, self._ctx)
        if exc is not None and not swallowed:
            return False  # the body's own error goes on
        error = self._worker._block_error(life)
        if error is not None:
            raise error from error.__cause__  # the prefill's failure, or nothing
        return swallowed


def _not_entered() -> RuntimeError:
    return RuntimeError(
        "a stream is read inside its block: async with worker.generate(...) as chunks"
    )


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
        self._reports = Reports(observer)
        #: What its requests share.
        self._shared = shared_by_worker(engine, self._features, policy, cleanups, self._reports)
        #: The requests whose ``generate`` block is open; closed by the shutdown.
        self._open_blocks: Drain[Lifecycle] = Drain()

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
        return len(self._open_blocks)

    @property
    def pending_cleanups(self) -> int:
        """Requests whose engine-side cleanup is still running."""
        return self._reports.pending

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
        parsed = parse_request(request, output, self._features, names)
        return parsed, self._runs_prefill_leg(parsed)

    def _runs_prefill_leg(self, parsed: ParsedRequest) -> bool:
        """Whether the worker runs the request's prefill leg at its peer (``_disagg.py``).

        A decode worker does, for a request that comes without its bootstrap
        (no router ran its prefill).
        """
        if self.role != "decode" or parsed.bootstrapped:
            return False
        if self._prefill is None:
            raise InvalidRequest(
                "a decode worker without a prefill peer needs the request's bootstrap_host, "
                "bootstrap_port and bootstrap_room (from the router that ran its prefill)"
            )
        if not parsed.single_sample:
            raise InvalidRequest(
                "a disaggregated request must be one prompt with n = 1 "
                "(the worker pairs its two legs by one bootstrap room)"
            )
        return True

    def generate(
        self,
        request: Mapping[str, Any] | PreparedRequest,
        ctx: RequestContext,
        output: OutputMode = "text",
    ) -> ResponseStream:
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
        return ResponseStream(self, request, ctx, output)

    def _open(
        self,
        request: Mapping[str, Any] | PreparedRequest,
        ctx: RequestContext,
        output: OutputMode,
    ) -> Lifecycle:
        """The block's start: the request checked, its lifecycle made and bound to ``ctx``."""
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
        if self._open_blocks.closed:
            raise EngineShutdown("the worker is shutting down")
        rids = parsed.mint_rids()
        ids = PublicIds.for_request(parsed, ctx.id)
        life = Lifecycle(
            self._engine.generate({**parsed.engine_request(rids), **(bootstrap or {})}),
            ids,
            rids if parsed.stable_ids else (),
            parsed.output,
            self._shared,
        )
        if bootstrap is not None:
            assert self._prefill is not None
            life.leg = PrefillLeg(
                self._prefill,
                {**parsed.body, **bootstrap},
                ids.request,
                rids,
                life.scope,
                self._reports,
                cancel_anytime=self._prefill_cancel_anytime,
                cleanup_timeout=self._policy.cleanup_timeout,
            )
        self._open_blocks.add(life)
        attach(ctx, life.scope)
        return life

    def _close_block(self, life: Lifecycle, ctx: RequestContext) -> None:
        """The block's end, however it ends: the stream closed, both legs stopped."""
        detach(ctx, life.scope)
        life.end_block()
        self._open_blocks.discard(life)

    def _block_error(self, life: Lifecycle) -> Exception | None:
        """What leaving a block that ended without an error of its own raises, if anything."""
        failure = life.prefill_error
        if failure is not None:
            error = EngineError(
                f"the prefill of {life.ids.request} failed ({type(failure).__name__})"
            )
            error.__cause__ = failure
            return error
        if self._open_blocks.closed and life.scope.cancelled_caught:
            return EngineShutdown("the worker shut down while the stream was open")
        return None

    # -- shutdown ------------------------------------------------------------

    def end_grace(self) -> None:
        """Cut the shutdown grace short, as a second signal asks; idempotent.

        Open streams are no longer waited for and pending cleanup is cancelled
        at once (now, or as soon as the shutdown begins); the engine still
        closes after, which stops whatever it still runs.
        """
        self._open_blocks.hurry()
        if self._open_blocks.closed:  # the shutdown has begun
            self._cleanups.close(trio.current_time())

    async def _shutdown(self) -> None:
        """End open streams; give them and the cleanup the grace as one deadline."""
        deadline = trio.current_time() + self._policy.shutdown_grace
        self._open_blocks.close()
        for life in self._open_blocks:
            life.scope.cancel()
        # Their callers hand the engine side over as their blocks exit.
        with trio.CancelScope(shield=True):
            await self._open_blocks.wait(deadline)
        self._cleanups.close(trio.current_time() if self._open_blocks.hurried else deadline)


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
                cut = worker._reports.cut_at_close
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
