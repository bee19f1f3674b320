"""A task of the worker that reads the engine stream, for when the caller's task cannot.

Two kinds of request need one:
- parallel sampling (``n > 1``): SGLang swaps every child rid for a fresh
  uuid that only the child's first output reveals, and has no group abort,
  so after the caller goes someone must keep reading to learn the children
  that have not spoken yet;
- any request on an engine whose close does not release it
  (``release_on_close`` false): cancelling the caller's pull would kill the
  generator before dispatch and leave the request registered for ever, so
  the generator has to keep running until the request is dispatched, and
  the abort follows the dispatch.

The pump runs in the worker's ``CleanupGroup`` from the caller's first pull,
and hands outputs over through a zero-buffer channel (the same back-pressure
as reading directly). When the caller goes, it fails closed, within the
request's cleanup deadline. If the engine's close releases every child
(SGLang 0.5.23), its pull is cancelled at once and the stream closes:
undispatched children never reach the scheduler. Otherwise every id known or
seen so far is aborted as soon as it is dispatched (woken, not polled; each
abort a task of the group), every child first seen later is aborted on
sight, the pump keeps reading for a bounded time, and closes the stream
last. Either way every id the request had is then checked to be gone.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any

import trio

from .._errors import EngineShutdown
from ._cleanup import EngineCleanup, EngineRequest
from ._cleanup_group import CleanupGroup
from ._policy import AbortPolicy

__all__ = ["EnginePump"]


class PumpState(enum.Enum):
    #: Made with its stream; nothing read yet.
    NEW = "new"
    #: Reading, and handing every output to the caller.
    FORWARDING = "forwarding"
    #: The caller is gone: reading on only to stop what it finds, bounded.
    FAILING_CLOSED = "failing closed"
    #: Done with the engine stream.
    DONE = "done"


# Read once per output: globals, not enum lookups (see _worker.py).
_NEW, _FORWARDING = PumpState.NEW, PumpState.FORWARDING
_FAILING_CLOSED, _DONE = PumpState.FAILING_CLOSED, PumpState.DONE


class EnginePump:
    def __init__(
        self,
        request: EngineRequest,
        cleanup: EngineCleanup,
        policy: AbortPolicy,
        *,
        release_on_close: bool,
        children_unknown: bool,
    ) -> None:
        self._request = request
        self._cleanup = cleanup
        self._policy = policy
        self._release_on_close = release_on_close
        self._children_unknown = children_unknown
        self._send, self._receive = trio.open_memory_channel[dict[str, Any]](0)
        # Unbounded while the caller reads; from its leaving, bounded by the
        # watch below and the request's cleanup deadline.
        self._pull_scope = trio.CancelScope()
        self._error: Exception | None = None
        self._state = _NEW

    def start(self, group: CleanupGroup) -> None:
        """Start reading, in a task of ``group`` (the caller's first pull)."""
        group.start_soon(self._run)
        self._state = _FORWARDING

    async def receive(self) -> dict[str, Any]:
        """The caller's pull: the next output, or the engine's error, or the end."""
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            if self._error is not None:
                raise self._error from None
            raise StopAsyncIteration from None

    def consumer_left(self) -> None:
        """Called in the caller's task as its stream closes, for any reason."""
        self._receive.close()
        if self._state is _NEW:
            self._state = _DONE  # never started: nothing reached the engine
        if self._state is not _FORWARDING:
            return
        self._fail_closed()
        if self._release_on_close:
            self._pull_scope.cancel()  # the engine's release path stops every child
            return
        for rid in self._request.unfinished():
            self._cleanup.start(self._request, self._cleanup.ordered_abort, self._request, rid)
        watch = self._policy.dispatch_timeout + self._policy.release_timeout
        if self._children_unknown:
            watch = self._policy.child_watch_timeout
        self._pull_scope.deadline = min(self._pull_scope.deadline, trio.current_time() + watch)

    def _fail_closed(self) -> None:
        self._state = _FAILING_CLOSED
        self._cleanup.begin(self._request)
        self._pull_scope.deadline = min(self._pull_scope.deadline, self._request.deadline)

    async def _run(self) -> None:
        timed_out = False
        try:
            if not await self._read():
                if self._state is _FORWARDING:
                    self._fail_closed()  # the engine failed: the caller gets its error
                with trio.move_on_at(self._request.deadline) as scope:
                    await self._cleanup.stop(self._request)
                timed_out = scope.cancelled_caught
            # Reading ran into the cleanup's deadline (a watch longer than cleanup_timeout).
            timed_out |= trio.current_time() >= self._request.deadline
        finally:
            if self._state is _FAILING_CLOSED:
                self._cleanup.end(self._request, timed_out=timed_out)
            self._state = _DONE

    async def _read(self) -> bool:
        """Read until the engine stream ends (True), or stop early (False)."""
        request = self._request
        try:
            with self._pull_scope:
                if self._state is not _FORWARDING:
                    return False  # the caller left before the first pull: nothing started
                async for out in request.stream:
                    child = request.note_child(out) if self._children_unknown else None
                    if self._state is _FORWARDING:
                        # BrokenResourceError: the caller left during the hand-over.
                        with contextlib.suppress(trio.BrokenResourceError):
                            await self._send.send(out)
                    elif child is not None and not request.children[child]:
                        # First seen after the cancel.
                        self._cleanup.start(request, self._cleanup.ordered_abort, request, child)
                if self._state is _FORWARDING:
                    # Before the channel closes: a caller that sees the end
                    # now must not count it as leaving early.
                    self._state = _DONE
                return True
        # Set before the channel closes, so that the caller raises it.
        except Exception as exc:
            self._error = exc
        except BaseException:
            # Cut by the worker's shutdown: a caller still reading must not
            # see its stream end as if normally.
            if self._state is _FORWARDING:
                self._error = EngineShutdown("the worker's tasks were cancelled")
            raise
        finally:
            # Closing it ends the caller's stream (a synchronous close: no
            # checkpoint per pump when a thousand are cancelled at once).
            self._send.close()
        return False
