"""Stopping a request at the engine once its caller has gone.

Everything here runs after the caller's stream has closed, as tasks of the
worker's ``CleanupGroup``, each bounded by the request's cleanup deadline
(``AbortPolicy.cleanup_timeout`` from the moment the caller left) and every
wait inside by its own ``AbortPolicy`` bound.

The order rests on how SGLang takes aborts. Closing the engine stream runs
SGLang's own release path (an undispatched request is forgotten and never
reaches the scheduler, a dispatched one is aborted), so that comes first.
An abort by id is the fallback, and it is never sent before the request is
dispatched: the scheduler matches aborts against the requests it has at
that moment and keeps no record of the others, so an early abort is lost,
and SGLang sends only the first abort of a request, so every later one is
dropped too. For the same reason, once the release path has sent a
request's abort, no second one is sent while the first is on its way (for
example behind a long prefill forward): it would only be dropped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVarTuple

import trio

from .._engine import Engine, EngineStream, RequestPhase
from .._errors import EngineError, EngineShutdown
from ._cleanup_group import CleanupGroup
from ._faults import EngineFault, FaultLog
from ._observer import WorkerObserver
from ._policy import AbortPolicy

__all__ = ["EngineCleanup", "EngineRequest"]

logger = logging.getLogger("trio_sglang")

Args = TypeVarTuple("Args")


@dataclass(eq=False, slots=True)
class EngineRequest:
    """One request as the engine knows it. Internal: never shown to the caller."""

    stream: EngineStream
    #: For logs: what the caller knows this request by.
    public_id: str
    #: Engine ids known before the request started (one, or one per prompt).
    rids: tuple[str, ...]
    #: Engine ids first seen in outputs (``n > 1``), mapped to "finished".
    children: dict[str, bool] = field(default_factory=dict)
    #: When the caller went and the cleanup became owed (trio clock).
    left_at: float | None = None
    #: ``left_at`` plus the policy's ``cleanup_timeout``: no cleanup task of
    #: this request runs past it.
    deadline: float = math.inf
    #: Cleanup tasks at work on this request; its cleanup is over when the
    #: last one ends.
    working: int = 0
    timed_out: bool = False
    #: Engine ids an ordered abort has already run for (each gets one, so a
    #: fault is retried a bounded number of times and reported once).
    abort_started: set[str] = field(default_factory=set)
    #: Engine ids whose abort the engine's release path has already sent
    #: (rarely any: an immutable default costs a request nothing).
    abort_sent: frozenset[str] = frozenset()

    def note_child(self, out: dict[str, Any]) -> str | None:
        """Record the output's engine id; return it when seen for the first time."""
        meta = out.get("meta_info") or {}
        rid = meta.get("id")
        if not isinstance(rid, str):
            return None
        new = rid not in self.children
        self.children[rid] = self.children.get(rid, False) or meta.get("finish_reason") is not None
        return rid if new else None

    def held_by(self, engine: Engine) -> list[str]:
        """The ids of this request that the engine still holds."""
        return [rid for rid in self.unfinished() if engine.phase(rid) is not RequestPhase.ABSENT]

    def unfinished(self) -> list[str]:
        """Every engine id that may still be running: known ones and unfinished children."""
        return [*self.rids, *(rid for rid, done in self.children.items() if not done)]


class EngineCleanup:
    """Stops requests at one engine, in tasks of the worker's ``CleanupGroup``."""

    def __init__(
        self,
        engine: Engine,
        policy: AbortPolicy,
        group: CleanupGroup,
        faults: FaultLog,
        observer: WorkerObserver | None,
    ) -> None:
        self._engine = engine
        self._policy = policy
        self._group = group
        self._faults = faults
        self._observer = observer
        #: Requests whose cleanup is running.
        self.pending = 0
        #: Requests whose cleanup the worker's shutdown cut after its grace.
        self.cut_at_close = 0
        features = engine.features()
        # The engine's release path aborts what was dispatched, and the engine
        # honours one abort per request: after it, another abort is dropped.
        self._release_aborts_once = features.release_on_close and features.abort_sent_flag

    # -- one request's cleanup, from the caller leaving to the last task ------

    def hand_over(self, request: EngineRequest, *, pull_cancelled: bool) -> None:
        """The caller of a stream it read itself has gone: stop the request at the engine.

        A cancelled pull ran the engine's release path; if the engine then
        holds none of the request's ids, there is nothing left to await (the
        usual case, and in a burst of cancels it spares a task per request).
        """
        if pull_cancelled:
            held = request.held_by(self._engine)
            if not held:
                if self._observer is not None:
                    self._observer.cleanup_finished(0.0, released=True)
                return
            if self._release_aborts_once:
                request.abort_sent |= frozenset(held)  # what it still holds was dispatched
        if not self.start(request, self.stop, request):
            logger.warning(
                "request %s ended after the worker closed; the engine closed with it",
                request.public_id,
            )

    def begin(self, request: EngineRequest) -> None:
        """One more task works on ``request``'s cleanup (owed from its first call)."""
        if request.left_at is None:
            request.left_at = trio.current_time()
            request.deadline = request.left_at + self._policy.cleanup_timeout
        if not request.working:
            self.pending += 1
        request.working += 1

    def end(self, request: EngineRequest, *, timed_out: bool) -> None:
        """A task ``begin`` counted has ended; after the last, say how the cleanup went."""
        request.working -= 1
        request.timed_out |= timed_out
        if request.working:
            return
        self.pending -= 1
        assert request.left_at is not None  # set by ``begin``
        cut = self._group.cutting
        if cut:
            # One summary at worker exit, not a line per request in a burst.
            self.cut_at_close += 1
            logger.debug("cleanup of request %s cancelled at shutdown", request.public_id)
        if self._observer is not None:
            self._observer.cleanup_finished(
                trio.current_time() - request.left_at,
                released=not request.held_by(self._engine),
            )
        if request.timed_out and not cut:
            self._faults.report(
                "cleanup_timeout",
                request.public_id,
                request.unfinished(),
                f"the cleanup ran past {self._policy.cleanup_timeout}s; "
                "the engine may still hold it",
                level=logging.WARNING,
            )

    def start(
        self,
        request: EngineRequest,
        work: Callable[[*Args], Awaitable[object]],
        *args: *Args,
    ) -> bool:
        """Run ``work(*args)`` for ``request``'s cleanup, as a task of the group.

        False if the group has closed (the worker is past its grace, and the
        engine closes with the request).
        """
        self.begin(request)
        try:
            self._group.start_soon(self._bounded, request, work, *args)
        except EngineShutdown:
            self.end(request, timed_out=False)
            return False
        return True

    async def _bounded(
        self,
        request: EngineRequest,
        work: Callable[[*Args], Awaitable[object]],
        *args: *Args,
    ) -> None:
        timed_out = False
        try:
            with trio.CancelScope(deadline=request.deadline) as scope:
                await work(*args)
            timed_out = scope.cancelled_caught
        finally:
            self.end(request, timed_out=timed_out)

    # -- engine faults the caller sees -----------------------------------------

    def failed(self, request: EngineRequest, error: BaseException) -> EngineError:
        """The engine's stream raised ``error``: logged whole, and the caller's error."""
        self._faults.report(
            "stream_error", request.public_id, request.unfinished(), repr(error), error=error
        )
        # The engine's own error may name internal ids: the caller gets its
        # type (and ``__cause__``), the log gets the whole of it.
        return EngineError(
            f"the engine failed while generating {request.public_id} ({type(error).__name__})"
        )

    def stalled(self, request: EngineRequest) -> EngineError:
        """No output within ``stall_timeout``: logged with the engine's phases, and the error."""
        timeout = self._policy.stall_timeout
        phases = ", ".join(self._engine.phase(rid).value for rid in request.unfinished())
        self._faults.report(
            "stream_stalled",
            request.public_id,
            request.unfinished(),
            f"no output for {timeout}s (engine phase: {phases or 'unknown'})",
        )
        return EngineError(f"the engine sent no output for {request.public_id} in {timeout}s")

    # -- the steps ------------------------------------------------------------

    async def stop(self, request: EngineRequest) -> None:
        """Close the stream, then make sure every id the request has is gone."""
        await self._close(request)
        rids = [rid for rid in request.unfinished() if rid not in request.abort_started]
        for rid in rids[1:]:  # a native batch: one task per prompt, no nested nursery
            self.start(request, self._settle, request, rid)
        if rids:
            await self._settle(request, rids[0])

    async def _close(self, request: EngineRequest) -> None:
        dispatched = []
        if self._release_aborts_once:
            phase = self._engine.phase
            dispatched = [r for r in request.unfinished() if phase(r) is RequestPhase.DISPATCHED]
        # Shielded even from the worker's shutdown: a half-closed stream is
        # worse than a short, bounded wait.
        with trio.move_on_after(self._policy.close_timeout, shield=True) as scope:
            try:
                await request.stream.aclose()
            except Exception as exc:
                self._faults.report(
                    "close_error",
                    request.public_id,
                    request.unfinished(),
                    "closing the engine stream raised",
                    error=exc,
                )
            else:
                request.abort_sent |= frozenset(dispatched)
        if scope.cancelled_caught:
            self._faults.report(
                "close_timeout",
                request.public_id,
                request.unfinished(),
                f"closing the engine stream took over {self._policy.close_timeout}s",
                level=logging.WARNING,
            )

    async def _settle(self, request: EngineRequest, rid: str) -> None:
        with trio.move_on_after(self._policy.release_timeout):
            await self._released(rid)
            return
        if rid in request.abort_sent:
            # Its abort is on its way (behind a forward in progress, say): a
            # second one would be dropped. Wait on, within the cleanup's deadline.
            await self._released(rid)
            return
        await self.ordered_abort(request, rid)

    async def _released(self, rid: str) -> None:
        """Return once the engine holds ``rid`` no more (unbounded: callers bound it)."""
        phase = self._engine.phase(rid)
        while phase is not RequestPhase.ABSENT:
            phase = await self._engine.wait_phase_change(rid, phase)

    async def ordered_abort(self, request: EngineRequest, rid: str) -> None:
        """Abort ``rid`` right after its dispatch (never before), bounded, retried.

        Runs once per rid of a request. Whatever goes wrong is reported once:
        the first failure if a retry then took, the last one if none did.
        """
        if rid in request.abort_started:
            return
        request.abort_started.add(rid)
        engine, policy, public_id = self._engine, self._policy, request.public_id
        phase = engine.phase(rid)
        if phase is RequestPhase.REGISTERED:
            with trio.move_on_after(policy.dispatch_timeout):
                phase = await engine.wait_phase_change(rid, phase)
            if phase is RequestPhase.REGISTERED:
                self._faults.report(
                    "dispatch_timeout",
                    public_id,
                    [rid],
                    f"still undispatched after {policy.dispatch_timeout}s; not aborted, "
                    "since an abort before dispatch is lost",
                )
                return
        failures: list[tuple[EngineFault, BaseException | None]] = []
        for attempt in range(1, policy.abort_attempts + 1):
            if phase is RequestPhase.ABSENT:
                break
            failure = await self._attempt_abort(rid)
            if failure is None:
                break
            failures.append(failure)
            if attempt < policy.abort_attempts:
                await trio.sleep(policy.abort_retry_delay)
            phase = engine.phase(rid)
        if not failures:
            return
        if engine.phase(rid) is RequestPhase.ABSENT:
            kind, error = failures[0]
            first = f" (the first: {error!r})" if error is not None else ""
            self._faults.report(
                kind,
                public_id,
                [rid],
                f"the engine let go of it after {len(failures)} failed abort attempt(s){first}",
                level=logging.WARNING,
            )
            return
        kind, error = failures[-1]
        self._faults.report(
            kind,
            public_id,
            [rid],
            f"the engine still holds it after {policy.abort_attempts} abort attempts",
            error=error,
        )

    async def _attempt_abort(self, rid: str) -> tuple[EngineFault, BaseException | None] | None:
        """One abort, bounded, then the wait for it to take; what went wrong, or None."""
        with trio.move_on_after(self._policy.abort_timeout) as call:
            try:
                await self._engine.abort(rid)
            except Exception as exc:
                return ("abort_error", exc)
        if call.cancelled_caught:
            return ("abort_timeout", None)
        with trio.move_on_after(self._policy.release_timeout):
            await self._released(rid)
            return None
        return ("abort_not_taken", None)
