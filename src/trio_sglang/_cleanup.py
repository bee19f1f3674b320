"""Stopping a request at the engine once its caller has gone.

Everything here runs after the caller's stream has closed, in tasks the
worker owns; each wait is bounded by ``AbortPolicy``. The order rests on
SGLANG_FACTS.md: closing the engine stream runs SGLang's own release path
(an undispatched request is forgotten, a dispatched one aborted), so that
comes first; an abort by id is the fallback, and it is never sent before the
request is dispatched, because the scheduler would lose it and SGLang would
then drop every later abort of that id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import trio

from ._engine import Engine, EngineStream, RequestPhase
from ._faults import EngineFault, FaultLog
from ._policy import AbortPolicy

__all__ = ["EngineCleanup", "EngineRequest"]


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
    cancelled_at: float | None = None
    #: Engine ids an ordered abort has already run for (each gets one, so a
    #: fault is retried a bounded number of times and reported once).
    abort_started: set[str] = field(default_factory=set)

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
    def __init__(self, engine: Engine, policy: AbortPolicy, faults: FaultLog) -> None:
        self._engine = engine
        self._policy = policy
        self._faults = faults

    async def stop(self, request: EngineRequest) -> None:
        """Close the stream, then make sure every id the request has is gone."""
        await self._close(request)
        rids = [rid for rid in request.unfinished() if rid not in request.abort_started]
        if len(rids) == 1:
            await self._settle(request, rids[0])
        elif rids:
            async with trio.open_nursery() as nursery:
                for rid in rids:
                    nursery.start_soon(self._settle, request, rid)

    async def _close(self, request: EngineRequest) -> None:
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
        if scope.cancelled_caught:
            self._faults.report(
                "close_timeout",
                request.public_id,
                request.unfinished(),
                f"closing the engine stream took over {self._policy.close_timeout}s",
                level=logging.WARNING,
            )

    async def _settle(self, request: EngineRequest, rid: str) -> None:
        if not await self._released_in_time(rid):
            await self.ordered_abort(request, rid)

    async def _released_in_time(self, rid: str) -> bool:
        """Whether the engine lets go of ``rid`` within ``policy.release_timeout``."""
        with trio.move_on_after(self._policy.release_timeout):
            phase = self._engine.phase(rid)
            while phase is not RequestPhase.ABSENT:
                phase = await self._engine.wait_phase_change(rid, phase)
            return True
        return False

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
        if not await self._released_in_time(rid):
            return ("abort_not_taken", None)
        return None
