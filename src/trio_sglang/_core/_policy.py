"""Every bound the lifecycle uses, in one frozen place."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .._request._values import check_at_least

__all__ = ["AbortPolicy"]

#: The policy's counts, not seconds: each one's least value.
_COUNTS = {"abort_attempts": 1, "outputs_after_abort": 0}


@dataclass(frozen=True, slots=True)
class AbortPolicy:
    """How long engine-side cleanup may take, and how often it may retry.

    All durations are seconds on the trio clock. None of them holds the
    caller's stream open: they bound the detached cleanup task that the worker
    runs after the stream has closed, and the worker's shutdown.
    """

    #: Bound on closing the engine stream (SGLang's own release path:
    #: an undispatched request is forgotten, a dispatched one is aborted).
    close_timeout: float = 1.0
    #: Bound on waiting for the engine to stop holding the request after it
    #: was closed or aborted (the scheduler's abort echo).
    release_timeout: float = 1.0
    #: Bound on waiting for dispatch when a request is still registered but
    #: undispatched after its stream was closed: an abort before dispatch is
    #: lost, so the lifecycle waits for dispatch (woken, not polled) first.
    dispatch_timeout: float = 5.0
    #: How many times an abort is sent when the engine raises or the abort
    #: does not take (at least 1); where the engine hears its scheduler, also
    #: how many aborts in all a request gets whose scheduler decodes it on.
    abort_attempts: int = 3
    #: Outputs of an aborted id the scheduler may still send (what was in
    #: flight when the abort arrived) before the abort counts as missed and is
    #: sent again (engines that hear their scheduler: ``Cleanup._confirm``).
    outputs_after_abort: int = 2
    #: Pause between abort attempts.
    abort_retry_delay: float = 0.005
    #: Bound on one call of the engine's abort (SGLang's is a socket send:
    #: microseconds, unless the scheduler's socket is stuck); a call that
    #: takes longer counts as a failed attempt.
    abort_timeout: float = 1.0
    #: Parallel sampling on an engine whose close does not release every
    #: child: how long to keep reading after the cancel, to abort children
    #: first seen then.
    child_watch_timeout: float = 1.0
    #: Overall bound on one request's cleanup task.
    cleanup_timeout: float = 10.0
    #: Longest the caller's stream waits for the engine's next output
    #: (the first one included) before it fails with ``EngineError`` and the
    #: request is stopped. Off by default: a request queued behind a full
    #: batch can legitimately wait minutes for its first token.
    stall_timeout: float = math.inf
    #: When the worker is left: how long open streams and pending cleanup get
    #: before the cleanup is cancelled and the engine closes.
    shutdown_grace: float = 1.0
    #: After that, how long the engine gets to close; an engine still closing
    #: then is cancelled and left behind (logged), so that the shutdown always
    #: finishes.
    engine_close_timeout: float = 10.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            name = f"AbortPolicy.{field.name}"
            if field.name in _COUNTS:
                check_at_least(name, value, _COUNTS[field.name], integer=True)
            else:
                check_at_least(name, value, 0)
