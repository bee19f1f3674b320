"""Hearing the scheduler take an abort, and sending it again where it did not.

An abort that left is not yet an abort taken. SGLang's scheduler can miss one
(SGLang issue #36876: it marks only the requests it finds in its running or
last batch, and one moving between batches decodes on), and nothing the
engine's own ``abort`` does reaches that request again: from 0.5.20 the
TokenizerManager sends only the first abort of a request, and 0.5.18 and
0.5.19 have already forgotten it on close. So where the engine hears its
scheduler (``HearsScheduler``), the lifecycle listens after the abort:

- the id's final output (its abort finish, or its natural end): taken;
- no output for ``release_timeout`` once the engine holds the id no more:
  the scheduler has gone quiet on it (while the engine holds it, a quiet
  scheduler is one busy with a long forward, and the lifecycle listens on,
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
from collections.abc import Callable

import trio

from .._engine import HearsScheduler, SchedulerEcho
from ._policy import AbortPolicy
from ._reports import Reports

__all__ = ["DEAF", "confirm_abort"]


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


async def confirm_abort(
    engine: HearsScheduler,
    policy: AbortPolicy,
    reports: Reports,
    public_id: str,
    rid: str,
    echo: SchedulerEcho,
    held: Callable[[], bool],
) -> None:
    """Listen to the scheduler on ``rid`` after its abort; send it again while it decodes on.

    ``held()``: whether the engine still holds ``rid``. Returns once the
    scheduler stopped, or once a fault (reported here) says it did not.
    """
    sent = 1
    since = 0  # outputs heard when the last abort went out
    while True:
        if not await _missed(echo, policy, since, held):
            break
        if sent == policy.abort_attempts:
            reports.fault(
                "abort_outlived",
                public_id,
                [rid],
                f"the scheduler decodes it on after {sent} aborts "
                f"({echo.outputs} outputs since the first)",
            )
            return
        with trio.move_on_after(policy.abort_timeout) as call:
            try:
                await engine.abort_again(rid)
            except Exception as exc:
                reports.fault("abort_error", public_id, [rid], "sending it again raised", error=exc)
                return
        if call.cancelled_caught:
            reports.fault(
                "abort_timeout",
                public_id,
                [rid],
                f"sending it again took over {policy.abort_timeout}s",
            )
            return
        sent += 1
        since = echo.outputs
    if sent > 1:
        reports.fault(
            "abort_missed",
            public_id,
            [rid],
            f"the scheduler decoded it on after its abort; it stopped after {sent} aborts "
            f"({echo.outputs} outputs since the first)",
            level=logging.WARNING,
        )


async def _missed(
    echo: SchedulerEcho, policy: AbortPolicy, since: int, held: Callable[[], bool]
) -> bool:
    """Whether the scheduler went on past the outputs in flight after an abort.

    False once it finished the id, or has been quiet on an id the engine
    no longer holds for ``release_timeout``.
    """
    while not echo.finished:
        if echo.outputs - since > policy.outputs_after_abort:
            return True
        with trio.move_on_after(policy.release_timeout) as quiet:
            await echo.changed()
        if quiet.cancelled_caught and not held():
            return False
    return False
