"""The cancellation lifecycle's entry: ``open_worker``, ``Worker.prepare`` and ``generate``.

One request's life, top to bottom:

1. ``generate`` makes the request's ``ResponseStream`` (``_lifecycle.py``):
   one object, from the block's start to the last cleanup task, with one
   ``State``. Entering its block checks the request here (``_check``: or
   takes what ``prepare`` checked), and that the engine honours every field
   it asks for (``InvalidRequest`` before anything reaches the engine).
2. The block ends, however it ends: the request leaves (its cleanup goes on
   in the worker's ``CleanupGroup``, bounded by ``AbortPolicy``, and never
   holds the caller's block open), and a prefill leg ends too.

The shape follows hypercorn's trio worker: the engine is entered first, the
``CleanupGroup`` is opened after it and closed before it, and leaving the
worker ends every open block (the ``Drain`` of their cancel scopes), then
gives their cleanup what is left of the grace as a deadline, and only then
lets the engine close.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from .._engine import Engine, EngineFeatures, Role
from .._errors import InvalidRequest
from .._request._parse import OutputMode, ParsedRequest, parse_request
from ._capabilities import build_capabilities
from ._cleanup_group import CleanupGroup, open_cleanup_group
from ._context import RequestContext
from ._disagg import PrefillPeer, peer_cancels_anytime
from ._lifecycle import ResponseStream
from ._policy import AbortPolicy
from ._reports import Reports, WorkerObserver
from ._shared import shared_by_worker

__all__ = ["PreparedRequest", "ResponseStream", "Worker", "open_worker"]

logger = logging.getLogger("trio_sglang")


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
        self._reports = Reports(observer)
        #: What its requests share; ``blocks``, the cancel scopes of the open blocks.
        self._shared = shared_by_worker(
            engine,
            self._features,
            policy,
            cleanups,
            self._reports,
            self._check,
            prefill,
            prefill_cancel_anytime,
        )
        self._open_blocks = self._shared.blocks

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
        return PreparedRequest(*self._parse(request, output, names or {}), self)

    def _check(self, request: object, output: OutputMode) -> tuple[ParsedRequest, bool]:
        """What a block runs: ``request`` checked for this worker, or what ``prepare`` made."""
        if isinstance(request, PreparedRequest):
            request.check_for(self, output)
            return request.parsed, request.prefill_leg
        return self._parse(request, output, {})

    def _parse(
        self, request: object, output: OutputMode, names: Mapping[str, str]
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
        return ResponseStream(self._shared, request, ctx, output)

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
        for scope in self._open_blocks:
            scope.cancel()
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
