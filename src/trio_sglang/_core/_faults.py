"""Engine faults: what went wrong at the engine, said once, with both ids.

A fault is anything the engine did that the lifecycle had to work around
or could not: a stream that raised or went silent, a close that raised or
hung, an abort that raised, hung or never took, a dispatch never observed.
Each one is logged exactly once per request (retries do not repeat it),
with the caller's public id and the engine's internal rids, and counted by
the worker's observer, so that metrics and logs agree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Literal

__all__ = ["EngineFault", "FaultLog"]

logger = logging.getLogger("trio_sglang")

EngineFault = Literal[
    "stream_error",  # the engine stream raised while the caller was reading it
    "stream_stalled",  # no output within ``AbortPolicy.stall_timeout``
    "close_error",  # closing the engine stream raised
    "close_timeout",  # closing the engine stream took over ``close_timeout``
    "abort_error",  # the engine's abort raised
    "abort_timeout",  # the engine's abort call took over ``abort_timeout``
    "abort_not_taken",  # the abort returned, but the engine kept the request
    "dispatch_timeout",  # still undispatched after ``dispatch_timeout``: not aborted
    "cleanup_timeout",  # the whole cleanup ran past ``cleanup_timeout``
    "prefill_failed",  # a decode worker's prefill leg failed at its prefill worker
]


class FaultLog:
    """Logs each fault, and tells ``counted`` (the worker's observer) of it."""

    def __init__(self, counted: Callable[[EngineFault], None] | None = None) -> None:
        self._counted = counted

    def report(
        self,
        kind: EngineFault,
        public_id: str,
        rids: Sequence[str],
        message: str,
        *,
        level: int = logging.ERROR,
        error: BaseException | None = None,
    ) -> None:
        """Log one fault of one request, and count it."""
        logger.log(
            level,
            "engine fault %s: request %s (rids %s): %s",
            kind,
            public_id,
            ", ".join(rids) or "none known",
            message,
            exc_info=error,
        )
        if self._counted is not None:
            self._counted(kind)
