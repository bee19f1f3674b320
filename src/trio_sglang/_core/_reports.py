"""What a worker tells of its requests' ends: the engine's faults, and each cleanup.

A fault is anything the engine did that the lifecycle had to work around
or could not: a stream that raised or went silent, a close that raised or
hung, an abort that raised, hung or never took, a dispatch never observed.
Each one is counted once per request (retries do not repeat it) by the
worker's observer, and logged with the caller's public id and the engine's
internal rids: the first ten of a kind in each ten seconds, and the next line
of that kind says how many were left out, so that requests which make the
engine fail at will cannot fill the log. No line carries more than a
bounded piece of what the engine said: its errors may hold a request whole.
Each cleanup is counted while it runs, timed when it ends, and counted again if the
worker's shutdown cut it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal, Protocol

from ._throttle import LogThrottle

__all__ = ["EngineFault", "Reports", "WorkerObserver", "describe"]

#: The most of a fault's message a log line carries.
_MESSAGE_CHARS = 300

logger = logging.getLogger("trio_sglang")

EngineFault = Literal[
    "stream_error",  # the engine stream raised while the caller was reading it
    "stream_stalled",  # no output within ``AbortPolicy.stall_timeout``
    "close_error",  # closing the engine stream raised
    "close_timeout",  # closing the engine stream took over ``close_timeout``
    "abort_error",  # the engine's abort raised
    "abort_timeout",  # the engine's abort call took over ``abort_timeout``
    "abort_not_taken",  # the abort returned, but the engine kept the request
    "abort_missed",  # the scheduler decoded on after the abort; sent again, it stopped
    "abort_outlived",  # the scheduler decoded on after every abort sent
    "dispatch_timeout",  # still undispatched after ``dispatch_timeout``: not aborted
    "cleanup_timeout",  # the whole cleanup ran past ``cleanup_timeout``
    "prefill_failed",  # a decode worker's prefill leg failed at its prefill worker
]


class WorkerObserver(Protocol):
    """What the worker tells an observer (the server's metrics)."""

    def cleanup_finished(self, seconds: float, *, released: bool) -> None:
        """One request's engine-side cleanup is over.

        ``seconds`` runs from the caller's leaving to the end of the cleanup;
        ``released`` says whether the engine had let go of every id of the
        request by then.
        """
        ...

    def engine_fault(self, kind: EngineFault) -> None:
        """The engine misbehaved once (see ``EngineFault``); already logged."""
        ...


class Reports:
    """One worker's account of its requests' ends: logged, counted, and told to ``observer``."""

    __slots__ = ("_throttle", "cut_at_close", "observer", "pending")

    def __init__(self, observer: WorkerObserver | None = None) -> None:
        self.observer = observer
        #: Requests whose cleanup is running.
        self.pending = 0
        #: Requests whose cleanup the worker's shutdown cut after its grace.
        self.cut_at_close = 0
        self._throttle = LogThrottle()

    def fault(
        self,
        kind: EngineFault,
        public_id: str,
        rids: Sequence[str],
        message: str,
        *,
        level: int = logging.ERROR,
        error: BaseException | None = None,
    ) -> None:
        """Count one fault of one request, and log it unless its kind is past its lines."""
        left_out = self._throttle.take(kind)
        if left_out is not None:
            if len(message) > _MESSAGE_CHARS:
                message = f"{message[:_MESSAGE_CHARS]}... ({len(message)} characters)"
            earlier = f" ({left_out} more of this kind not logged before it)" if left_out else ""
            logger.log(
                level,
                "engine fault %s: request %s (rids %s): %s%s",
                kind,
                public_id,
                ", ".join(rids) or "none known",
                message,
                earlier,
                exc_info=error,
            )
        if self.observer is not None:
            self.observer.engine_fault(kind)

    def cleanup_finished(self, seconds: float, *, released: bool) -> None:
        if self.observer is not None:
            self.observer.cleanup_finished(seconds, released=released)


def describe(error: BaseException) -> str:
    """An error in a log line: its type and message, not its ``repr``.

    The ``repr`` of some errors holds their whole input: a
    ``UnicodeEncodeError``'s is the string it could not encode, a request
    body with its prompt.
    """
    return f"{type(error).__name__}: {error}"
