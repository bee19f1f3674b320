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
from ._policy import AbortPolicy

__all__ = ["EngineCleanup", "EngineRequest"]

logger = logging.getLogger("trio_sglang")


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
    def __init__(self, engine: Engine, policy: AbortPolicy) -> None:
        self._engine = engine
        self._policy = policy

    async def stop(self, request: EngineRequest) -> None:
        """Close the stream, then make sure every id the request has is gone."""
        await self._close(request)
        rids = request.unfinished()
        if len(rids) == 1:
            await self._settle(rids[0], request.public_id)
        elif rids:
            async with trio.open_nursery() as nursery:
                for rid in rids:
                    nursery.start_soon(self._settle, rid, request.public_id)

    async def _close(self, request: EngineRequest) -> None:
        # Shielded even from the worker's shutdown: a half-closed stream is
        # worse than a short, bounded wait.
        with trio.move_on_after(self._policy.close_timeout, shield=True) as scope:
            try:
                await request.stream.aclose()
            except Exception:
                logger.exception(
                    "closing the engine stream of %s (rids %s) failed",
                    request.public_id,
                    request.unfinished(),
                )
        if scope.cancelled_caught:
            logger.warning(
                "closing the engine stream of %s took over %ss",
                request.public_id,
                self._policy.close_timeout,
            )

    async def _settle(self, rid: str, public_id: str) -> None:
        if not await self._released_in_time(rid):
            await self.ordered_abort(rid, public_id)

    async def _released_in_time(self, rid: str) -> bool:
        """Whether the engine lets go of ``rid`` within ``policy.release_timeout``."""
        with trio.move_on_after(self._policy.release_timeout):
            phase = self._engine.phase(rid)
            while phase is not RequestPhase.ABSENT:
                phase = await self._engine.wait_phase_change(rid, phase)
            return True
        return False

    async def ordered_abort(self, rid: str, public_id: str) -> None:
        """Abort ``rid`` right after its dispatch (never before), bounded, retried."""
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
