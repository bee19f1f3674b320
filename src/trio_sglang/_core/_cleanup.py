"""One request's engine side once its caller has gone: ``Cleanup``, and the ordered abort.

A request whose caller left while the engine may still hold it gets a
``Cleanup``, made by its ``Lifecycle`` then (one the engine let go of gets
none). Each task of it runs in the worker's ``CleanupGroup``, bounded by the
request's cleanup deadline (``AbortPolicy.cleanup_timeout`` from the caller's
leaving) and every wait inside by its own ``AbortPolicy`` bound; the last
task to end says how the cleanup went and tells the lifecycle.

The order rests on how SGLang takes aborts. Closing the engine stream runs
SGLang's own release path (an undispatched request is forgotten and never
reaches the scheduler, a dispatched one is aborted), so ``Cleanup.stop``
does that first. An abort by id is the fallback, and it is never sent
before the id is dispatched: the scheduler matches aborts against the
requests it has at that moment and keeps no record of the others, so an
early abort is lost, and SGLang sends only the first abort of a request, so
every later one is dropped too. For the same reason, once the release path
has sent a request's abort, no second one is sent while the first is on its
way (behind a long prefill forward, say). Where the engine hears its
scheduler, every abort that left is then listened to until the scheduler
takes it, and sent again past that rule if the scheduler decodes on
(``_confirm.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, TypeVarTuple

import trio

from .._engine import Engine, EngineStream, HearsScheduler, RequestPhase, SchedulerEcho
from .._errors import EngineShutdown
from ._confirm import confirm_abort
from ._outputs import PublicIds
from ._policy import AbortPolicy
from ._reports import EngineFault, Reports
from ._shared import Shared

__all__ = ["Cleanup", "Stoppable", "held", "ordered_abort", "released", "scheduler_done"]

logger = logging.getLogger("trio_sglang")

Args = TypeVarTuple("Args")


class Stoppable(Protocol):
    """The request a ``Cleanup`` stops, as it sees it (its ``Lifecycle``)."""

    @property
    def stream(self) -> EngineStream: ...

    @property
    def ids(self) -> PublicIds: ...

    def unfinished(self) -> list[str]:
        """The request's engine ids that may still run (children come and finish as the
        reader reads on)."""
        ...

    def stopped(self) -> None:
        """The last task of the cleanup has ended."""
        ...


class Cleanup:
    """One request's engine side after its caller left: the tasks that stop it, counted."""

    __slots__ = (
        "_request",
        "_shared",
        "abort_sent",
        "abort_started",
        "deadline",
        "left_at",
        "timed_out",
        "working",
    )

    def __init__(self, shared: Shared, request: Stoppable, abort_sent: frozenset[str]) -> None:
        """``abort_sent``: the ids whose abort the engine's release path has already sent."""
        self._shared = shared
        self._request = request
        #: Engine ids whose abort the engine's release path has already sent.
        self.abort_sent = abort_sent
        #: Engine ids an ordered abort has already run for (each gets one, so a
        #: fault is retried a bounded number of times and reported once).
        self.abort_started: frozenset[str] = frozenset()
        #: When the caller went and the cleanup became owed (trio clock).
        self.left_at = trio.current_time()
        #: No task of this cleanup runs past it.
        self.deadline = self.left_at + shared.policy.cleanup_timeout
        #: Tasks at work on the cleanup; the request is stopped when the last one ends.
        self.working = 0
        self.timed_out = False

    def begin(self) -> None:
        """One more task works on the cleanup (owed from the first one)."""
        if not self.working:
            self._shared.reports.pending += 1
        self.working += 1

    def end(self, *, timed_out: bool) -> None:
        """A task ``begin`` counted has ended; after the last, say how the cleanup went."""
        self.working -= 1
        self.timed_out |= timed_out
        if self.working:
            return
        reports = self._shared.reports
        reports.pending -= 1
        cut = self._shared.group.cutting
        if cut:
            # One summary at worker exit, not a line per request in a burst.
            reports.cut_at_close += 1
            logger.debug("cleanup of request %s cancelled at shutdown", self._request.ids.request)
        still = held(self._shared.engine, self._request.unfinished())
        reports.cleanup_finished(trio.current_time() - self.left_at, released=not still)
        if self.timed_out and not cut:
            reports.fault(
                "cleanup_timeout",
                self._request.ids.request,
                self._request.unfinished(),
                f"the cleanup ran past {self._shared.policy.cleanup_timeout}s; "
                "the engine may still hold it",
                level=logging.WARNING,
            )
        self._request.stopped()

    def start(self, work: Callable[[*Args], Awaitable[object]], *args: *Args) -> bool:
        """Run ``work(*args)`` as a task of the cleanup, in the worker's group.

        False if the group has closed (the worker is past its grace, and the
        engine closes with the request).
        """
        self.begin()
        try:
            self._shared.group.start_soon(self._bounded, work, *args)
        except EngineShutdown:
            self.end(timed_out=False)
            return False
        return True

    async def _bounded(self, work: Callable[[*Args], Awaitable[object]], *args: *Args) -> None:
        timed_out = False
        try:
            with trio.CancelScope(deadline=self.deadline) as scope:
                await work(*args)
            timed_out = scope.cancelled_caught
        finally:
            self.end(timed_out=timed_out)

    async def stop(self) -> None:
        """Close the engine stream, then make sure every id the request has is gone."""
        await self._close()
        rids = [rid for rid in self._request.unfinished() if rid not in self.abort_started]
        for rid in rids[1:]:  # a native batch: one task per prompt, no nested nursery
            self.start(self._settle, rid)
        if rids:
            await self._settle(rids[0])

    async def _close(self) -> None:
        shared = self._shared
        dispatched = []
        if shared.release_aborts_once:
            phase = shared.engine.phase
            dispatched = [
                r for r in self._request.unfinished() if phase(r) is RequestPhase.DISPATCHED
            ]
        # Shielded even from the worker's shutdown: a half-closed stream is
        # worse than a short, bounded wait.
        with trio.move_on_after(shared.policy.close_timeout, shield=True) as scope:
            try:
                await self._request.stream.aclose()
            except Exception as exc:
                shared.reports.fault(
                    "close_error",
                    self._request.ids.request,
                    self._request.unfinished(),
                    "closing the engine stream raised",
                    error=exc,
                )
            else:
                self.abort_sent |= frozenset(dispatched)
        if scope.cancelled_caught:
            shared.reports.fault(
                "close_timeout",
                self._request.ids.request,
                self._request.unfinished(),
                f"closing the engine stream took over {shared.policy.close_timeout}s",
                level=logging.WARNING,
            )

    async def _settle(self, rid: str) -> None:
        if (echo := self._shared.hears.echo(rid)) is not None:
            await self._confirm(rid, echo)  # the scheduler's own word
            return
        with trio.move_on_after(self._shared.policy.release_timeout):
            await released(self._shared.engine, rid)
            return
        if rid in self.abort_sent:
            # Its abort is on its way (behind a forward in progress, say): a
            # second one would be dropped. Wait on, within the cleanup's deadline.
            await released(self._shared.engine, rid)
            return
        await self.ordered_abort(rid)

    async def ordered_abort(self, rid: str) -> None:
        """The ordered abort of ``rid`` (``ordered_abort`` below), once per id of the request."""
        if rid in self.abort_started:
            return
        self.abort_started |= {rid}
        shared = self._shared
        await ordered_abort(
            shared.engine,
            shared.policy,
            shared.reports,
            self._request.ids.request,
            rid,
            shared.hears,
        )
        if (echo := shared.hears.echo(rid)) is not None:
            await self._confirm(rid, echo)

    async def _confirm(self, rid: str, echo: SchedulerEcho) -> None:
        """What the scheduler says after the abort (``_confirm.py``)."""
        shared = self._shared
        phase = shared.engine.phase

        def still_held() -> bool:
            return phase(rid) is not RequestPhase.ABSENT

        try:
            await confirm_abort(
                shared.hears,
                shared.policy,
                shared.reports,
                self._request.ids.request,
                rid,
                echo,
                still_held,
            )
        finally:
            shared.hears.forget_echo(rid)


def held(engine: Engine, rids: Iterable[str]) -> list[str]:
    """Those of ``rids`` that the engine still holds."""
    phase = engine.phase
    return [rid for rid in rids if phase(rid) is not RequestPhase.ABSENT]


def scheduler_done(hears: HearsScheduler, rids: Iterable[str]) -> bool:
    """Whether the scheduler finished every one of ``rids`` it was sent an abort for.

    Their echoes are forgotten then; one still open needs a cleanup task to listen to it.
    """
    echoes = [(rid, echo) for rid in rids if (echo := hears.echo(rid)) is not None]
    if not all(echo.finished for _, echo in echoes):
        return False
    for rid, _ in echoes:
        hears.forget_echo(rid)
    return True


async def released(engine: Engine, rid: str) -> None:
    """Return once the engine holds ``rid`` no more (unbounded: callers bound it)."""
    phase = engine.phase(rid)
    while phase is not RequestPhase.ABSENT:
        phase = await engine.wait_phase_change(rid, phase)


async def ordered_abort(
    engine: Engine,
    policy: AbortPolicy,
    reports: Reports,
    public_id: str,
    rid: str,
    hears: HearsScheduler,
) -> None:
    """Abort ``rid`` right after its dispatch (never before), bounded, retried.

    Whatever goes wrong is reported once: the first failure if a retry then
    took, the last one if none did. Where the engine hears its scheduler
    (``hears`` has its echo), an abort that left is the caller's to confirm
    (``_confirm.py``).
    """
    phase = engine.phase(rid)
    if phase is RequestPhase.REGISTERED:
        with trio.move_on_after(policy.dispatch_timeout):
            phase = await engine.wait_phase_change(rid, phase)
        if phase is RequestPhase.REGISTERED:
            reports.fault(
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
        failure = await _attempt_abort(engine, policy, rid, hears)
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
        reports.fault(
            kind,
            public_id,
            [rid],
            f"the engine let go of it after {len(failures)} failed abort attempt(s){first}",
            level=logging.WARNING,
        )
        return
    kind, error = failures[-1]
    reports.fault(
        kind,
        public_id,
        [rid],
        f"the engine still holds it after {policy.abort_attempts} abort attempts",
        error=error,
    )


async def _attempt_abort(
    engine: Engine, policy: AbortPolicy, rid: str, hears: HearsScheduler
) -> tuple[EngineFault, BaseException | None] | None:
    """One abort, bounded, then the wait for it to take; what went wrong, or None."""
    with trio.move_on_after(policy.abort_timeout) as call:
        try:
            await engine.abort(rid)
        except Exception as exc:
            return ("abort_error", exc)
    if call.cancelled_caught:
        return ("abort_timeout", None)
    if hears.echo(rid) is not None:
        return None  # it left: the scheduler's answer is listened to next
    with trio.move_on_after(policy.release_timeout):
        await released(engine, rid)
        return None
    return ("abort_not_taken", None)
