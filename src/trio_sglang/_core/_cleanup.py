"""Stopping one engine id whose caller has gone: the ordered abort.

The order rests on how SGLang takes aborts. Closing the engine stream runs
SGLang's own release path (an undispatched request is forgotten and never
reaches the scheduler, a dispatched one is aborted), so the request's
cleanup does that first (see ``Lifecycle.stop``). An abort by id is the
fallback, and it is never sent before the id is dispatched: the scheduler
matches aborts against the requests it has at that moment and keeps no
record of the others, so an early abort is lost, and SGLang sends only the
first abort of a request, so every later one is dropped too.
"""

from __future__ import annotations

import logging

import trio

from .._engine import Engine, HearsScheduler, RequestPhase
from ._policy import AbortPolicy
from ._reports import EngineFault, Reports

__all__ = ["ordered_abort", "released"]


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
