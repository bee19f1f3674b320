"""What every request of one worker shares: ``Shared``, made once by the worker.

A request's ``ResponseStream`` and its ``Cleanup`` read the engine, the
policy, the worker's checks and the owners of their tasks from here rather
than holding a copy each (or their worker: the stream is the worker's to
make, not the other way round), and ask the engine about their ids through
it: whether it still holds them, and whether its scheduler finished them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio

from .._engine import Engine, EngineFeatures, HearsScheduler, RequestPhase, SchedulerEcho
from .._request._parse import OutputMode, ParsedRequest
from ._cleanup_group import CleanupGroup
from ._disagg import PrefillPeer
from ._drain import Drain
from ._policy import AbortPolicy
from ._reports import Reports

#: How the worker checks a request (a body, or what ``Worker.prepare`` made of one) for
#: an output: the request to run, and whether its prefill leg runs at the worker's peer.
Check = Callable[[object, OutputMode], tuple[ParsedRequest, bool]]

__all__ = ["DEAF", "Shared", "shared_by_worker"]


@dataclass(frozen=True, slots=True)
class Shared:
    """What every request of one worker shares: made once, by the worker (``shared_by_worker``)."""

    engine: Engine
    policy: AbortPolicy
    #: The worker's owner of every engine-side task.
    group: CleanupGroup
    reports: Reports
    #: Whether closing the engine stream runs the engine's release path.
    release_on_close: bool
    #: The engine's release path aborts what was dispatched, and the engine
    #: honours one abort per request: after it, another abort is dropped.
    release_aborts_once: bool
    #: ``policy.stall_timeout``, or ``None`` where it bounds nothing.
    stall_timeout: float | None
    #: The engine, if it hears its scheduler; ``DEAF`` otherwise.
    hears: HearsScheduler
    #: ``InvalidRequest`` for what the worker cannot run (``Worker._check``).
    check: Check
    #: The cancel scopes of the open ``generate`` blocks; closed by the shutdown.
    blocks: Drain[trio.CancelScope]
    #: Where a decode worker runs its requests' prefill legs, if anywhere.
    prefill: PrefillPeer | None
    #: Whether a cancel stops a prefill leg at ``prefill`` in any queue.
    prefill_cancel_anytime: bool

    def held(self, rids: Iterable[str]) -> list[str]:
        """Those of ``rids`` that the engine still holds."""
        phase = self.engine.phase
        return [rid for rid in rids if phase(rid) is not RequestPhase.ABSENT]

    async def released(self, rid: str) -> None:
        """Return once the engine holds ``rid`` no more (unbounded: callers bound it)."""
        phase = self.engine.phase(rid)
        while phase is not RequestPhase.ABSENT:
            phase = await self.engine.wait_phase_change(rid, phase)

    def scheduler_done(self, rids: Iterable[str]) -> bool:
        """Whether the scheduler finished every one of ``rids`` it was sent an abort for.

        Their echoes are forgotten then; one still open needs a cleanup task to listen to it.
        """
        hears = self.hears
        echoes = [(rid, echo) for rid in rids if (echo := hears.echo(rid)) is not None]
        if not all(echo.finished for _, echo in echoes):
            return False
        for rid, _ in echoes:
            hears.forget_echo(rid)
        return True


class _Deaf:
    """An engine that does not hear its scheduler, as the lifecycle sees it: no echo, ever."""

    def echo(self, rid: str) -> SchedulerEcho | None:
        return None

    def forget_echo(self, rid: str) -> None:
        return None

    async def abort_again(self, rid: str) -> None:
        raise RuntimeError("there is no echo to confirm: nothing is sent again")


#: What the lifecycle listens to where the engine does not hear its scheduler.
DEAF: HearsScheduler = _Deaf()


def shared_by_worker(
    engine: Engine,
    features: EngineFeatures,
    policy: AbortPolicy,
    group: CleanupGroup,
    reports: Reports,
    check: Check,
    prefill: PrefillPeer | None,
    prefill_cancel_anytime: bool,
) -> Shared:
    """What a worker's requests share, from its engine, the engine's features and its policy."""
    return Shared(
        engine,
        policy,
        group,
        reports,
        features.release_on_close,
        features.release_on_close and features.abort_sent_flag,
        None if policy.stall_timeout == math.inf else policy.stall_timeout,
        engine if isinstance(engine, HearsScheduler) else DEAF,
        check,
        Drain(),
        prefill,
        prefill_cancel_anytime,
    )
