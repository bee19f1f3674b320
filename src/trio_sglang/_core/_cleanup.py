"""One request's engine side once its caller has gone: ``Cleanup``, and the ordered abort.

A request whose caller left while the engine may still hold it gets a
``Cleanup``, made by its ``ResponseStream`` then (one the engine let go of gets
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
way (behind a long prefill forward, say).

An abort that left is not yet an abort taken. SGLang's scheduler can miss
one (SGLang issue #36876: it marks only the requests it finds in its running
or last batch, and one moving between batches decodes on), and nothing the
engine's own ``abort`` does reaches that request again: from 0.5.20 the
TokenizerManager sends only the first abort of a request, and 0.5.18 and
0.5.19 have already forgotten it on close. So where the engine hears its
scheduler (``HearsScheduler``), the cleanup listens after the abort
(``Cleanup._confirm``):

- the id's final output (its abort finish, or its natural end): taken;
- no output for ``release_timeout`` once the engine holds the id no more:
  the scheduler has gone quiet on it (while the engine holds it, a quiet
  scheduler is one busy with a long forward, and the cleanup listens on,
  within the request's cleanup deadline);
- more than ``outputs_after_abort`` outputs since the abort (what was in flight
  when it arrived): missed, and sent again, straight to the scheduler, at most
  ``abort_attempts`` aborts in all.

A request that the scheduler let go after an abort sent again is reported
once as ``abort_missed``; one still decoding after every abort, as
``abort_outlived``. The first abort always comes from the engine's own path
(its release on close, or the ordered abort after dispatch), so an abort sent
again never reaches the scheduler before its request.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVarTuple

import trio

from .._engine import EngineStream, RequestPhase, SchedulerEcho
from .._errors import EngineShutdown
from ._outputs import PublicIds
from ._reports import EngineFault
from ._shared import Shared

__all__ = ["Cleanup", "Stoppable"]

logger = logging.getLogger("trio_sglang")

Args = TypeVarTuple("Args")


class Stoppable(Protocol):
    """The request a ``Cleanup`` stops, as it sees it (its ``ResponseStream``)."""

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
        still = self._shared.held(self._request.unfinished())
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
            await self._shared.released(rid)
            return
        if rid in self.abort_sent:
            # Its abort is on its way (behind a forward in progress, say): a
            # second one would be dropped. Wait on, within the cleanup's deadline.
            await self._shared.released(rid)
            return
        await self.ordered_abort(rid)

    async def ordered_abort(self, rid: str) -> None:
        """Abort ``rid`` right after its dispatch (never before), bounded, retried; once per id.

        Whatever goes wrong is reported once: the first failure if a retry
        then took, the last one if none did. Where the engine hears its
        scheduler, an abort that left is then listened to (``_confirm``).
        """
        if rid in self.abort_started:
            return
        self.abort_started |= {rid}
        await self._abort_after_dispatch(rid)
        if (echo := self._shared.hears.echo(rid)) is not None:
            await self._confirm(rid, echo)

    async def _abort_after_dispatch(self, rid: str) -> None:
        engine, policy = self._shared.engine, self._shared.policy
        phase = engine.phase(rid)
        if phase is RequestPhase.REGISTERED:
            with trio.move_on_after(policy.dispatch_timeout):
                phase = await engine.wait_phase_change(rid, phase)
            if phase is RequestPhase.REGISTERED:
                self._fault(
                    "dispatch_timeout",
                    rid,
                    f"still undispatched after {policy.dispatch_timeout}s; not aborted, "
                    "since an abort before dispatch is lost",
                )
                return
        failures: list[tuple[EngineFault, BaseException | None]] = []
        for attempt in range(1, policy.abort_attempts + 1):
            if phase is RequestPhase.ABSENT:
                break
            failure = await self._attempt(rid)
            if failure is None:
                break
            failures.append(failure)
            if attempt < policy.abort_attempts:
                await trio.sleep(policy.abort_retry_delay)
            phase = engine.phase(rid)
        if failures:
            self._report_failures(rid, failures)

    def _report_failures(
        self, rid: str, failures: list[tuple[EngineFault, BaseException | None]]
    ) -> None:
        if self._shared.engine.phase(rid) is RequestPhase.ABSENT:
            kind, error = failures[0]
            first = f" (the first: {error!r})" if error is not None else ""
            self._fault(
                kind,
                rid,
                f"the engine let go of it after {len(failures)} failed abort attempt(s){first}",
                level=logging.WARNING,
            )
            return
        kind, error = failures[-1]
        self._fault(
            kind,
            rid,
            f"the engine still holds it after {self._shared.policy.abort_attempts} abort attempts",
            error=error,
        )

    async def _attempt(self, rid: str) -> tuple[EngineFault, BaseException | None] | None:
        """One abort, bounded, then the wait for it to take; what went wrong, or None."""
        shared = self._shared
        with trio.move_on_after(shared.policy.abort_timeout) as call:
            try:
                await shared.engine.abort(rid)
            except Exception as exc:
                return ("abort_error", exc)
        if call.cancelled_caught:
            return ("abort_timeout", None)
        if shared.hears.echo(rid) is not None:
            return None  # it left: the scheduler's answer is listened to next
        with trio.move_on_after(shared.policy.release_timeout):
            await shared.released(rid)
            return None
        return ("abort_not_taken", None)

    async def _confirm(self, rid: str, echo: SchedulerEcho) -> None:
        """Listen to the scheduler on ``rid`` after its abort; send it again while it decodes on.

        Returns once the scheduler stopped, or once a fault (reported here)
        says it did not; the echo is forgotten then.
        """
        try:
            await self._abort_until_taken(rid, echo)
        finally:
            self._shared.hears.forget_echo(rid)

    async def _abort_until_taken(self, rid: str, echo: SchedulerEcho) -> None:
        policy = self._shared.policy
        sent = 1
        since = 0  # outputs heard when the last abort went out
        while await self._missed(rid, echo, since):
            if sent == policy.abort_attempts:
                self._fault(
                    "abort_outlived",
                    rid,
                    f"the scheduler decodes it on after {sent} aborts "
                    f"({echo.outputs} outputs since the first)",
                )
                return
            with trio.move_on_after(policy.abort_timeout) as call:
                try:
                    await self._shared.hears.abort_again(rid)
                except Exception as exc:
                    self._fault("abort_error", rid, "sending it again raised", error=exc)
                    return
            if call.cancelled_caught:
                self._fault(
                    "abort_timeout", rid, f"sending it again took over {policy.abort_timeout}s"
                )
                return
            sent += 1
            since = echo.outputs
        if sent > 1:
            self._fault(
                "abort_missed",
                rid,
                f"the scheduler decoded it on after its abort; it stopped after {sent} aborts "
                f"({echo.outputs} outputs since the first)",
                level=logging.WARNING,
            )

    async def _missed(self, rid: str, echo: SchedulerEcho, since: int) -> bool:
        """Whether the scheduler went on past the outputs in flight after an abort.

        False once it finished the id, or has been quiet on an id the engine
        no longer holds for ``release_timeout``.
        """
        policy = self._shared.policy
        while not echo.finished:
            if echo.outputs - since > policy.outputs_after_abort:
                return True
            with trio.move_on_after(policy.release_timeout) as quiet:
                await echo.changed()
            if quiet.cancelled_caught and self._shared.engine.phase(rid) is RequestPhase.ABSENT:
                return False
        return False

    def _fault(
        self,
        kind: EngineFault,
        rid: str,
        message: str,
        *,
        level: int = logging.ERROR,
        error: BaseException | None = None,
    ) -> None:
        """One fault of one of the request's ids."""
        self._shared.reports.fault(
            kind, self._request.ids.request, [rid], message, level=level, error=error
        )
