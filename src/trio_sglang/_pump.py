"""A task of the worker that owns the engine stream, for when the caller's task cannot.

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

The pump hands outputs to the caller through a zero-buffer channel (the same
back-pressure as reading directly). When the caller goes, the pump becomes a
cleanup task of the worker (shielded, bounded, cancelled at shutdown after
the grace) and fails closed. If the engine's close releases every child
(SGLang 0.5.23), its pull is cancelled at once and the stream closes:
undispatched children never reach the scheduler. Otherwise every id known or
seen so far is aborted as soon as it is dispatched (woken, not polled),
every child first seen later is aborted on sight, the pump keeps reading for
a bounded time, and closes the stream last. Either way every id the request
had is then checked to be gone.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import trio

from ._cleanup import EngineCleanup, EngineRequest
from ._errors import EngineShutdown
from ._policy import AbortPolicy

if TYPE_CHECKING:
    from ._worker import Worker

__all__ = ["EnginePump"]


class EnginePump:
    def __init__(
        self,
        worker: Worker,
        request: EngineRequest,
        cleanup: EngineCleanup,
        policy: AbortPolicy,
        *,
        release_on_close: bool,
        children_unknown: bool,
    ) -> None:
        self._worker = worker
        self._request = request
        self._cleanup = cleanup
        self._policy = policy
        self._release_on_close = release_on_close
        self._children_unknown = children_unknown
        self._send, self._receive = trio.open_memory_channel[dict[str, Any]](0)
        self._scope = trio.CancelScope()  # becomes a cleanup scope when the caller goes
        self._pull_scope = trio.CancelScope()
        self._aborts: trio.Nursery | None = None
        self._error: Exception | None = None
        self._consumer_gone = False
        self._reading = True
        self._cleaning = False

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
        self._consumer_gone = True
        self._receive.close()
        if not self._reading:
            return
        self._become_cleanup()
        if self._aborts is None:
            return  # the pump has not started reading, and now never will
        if self._release_on_close:
            self._pull_scope.cancel()  # the engine's release path stops every child
            return
        for rid in self._request.unfinished():
            self._abort_when_dispatched(rid)
        watch = self._policy.dispatch_timeout + self._policy.release_timeout
        if self._children_unknown:
            watch = self._policy.child_watch_timeout
        self._pull_scope.deadline = min(self._pull_scope.deadline, trio.current_time() + watch)

    async def run(self) -> None:
        ended = False
        with self._scope:
            try:
                async with trio.open_nursery() as self._aborts:
                    ended = await self._read()
                    self._reading = False
                    if not ended:
                        self._become_cleanup()
                        await self._cleanup.stop(self._request)
            finally:
                self._reading = False
                if self._cleaning:
                    self._worker._end_cleanup(self._scope, self._request)
        if self._cleaning and self._scope.cancelled_caught:
            self._worker._log_unfinished_cleanup(self._request, self._scope)

    def _become_cleanup(self) -> None:
        if not self._cleaning:
            self._cleaning = True
            self._worker._begin_cleanup(self._request)
            self._worker._guard_cleanup(self._scope)

    def _abort_when_dispatched(self, rid: str) -> None:
        assert self._aborts is not None  # only called while reading, inside the nursery
        self._aborts.start_soon(self._cleanup.ordered_abort, self._request, rid)

    async def _read(self) -> bool:
        """Read until the engine stream ends (True), or stop early (False)."""
        request = self._request
        try:
            with self._pull_scope:
                if self._consumer_gone:
                    return False  # gone before the first pull: nothing started
                async for out in request.stream:
                    child = request.note_child(out) if self._children_unknown else None
                    if not self._consumer_gone:
                        # BrokenResourceError: the caller left during the hand-over.
                        with contextlib.suppress(trio.BrokenResourceError):
                            await self._send.send(out)
                    elif child is not None and not request.children[child]:
                        self._abort_when_dispatched(child)  # first seen after the cancel
                # Before the channel closes: a caller that sees the end now
                # must not count it as leaving early.
                self._reading = False
                return True
        # Set before the channel closes, so that the caller raises it.
        except Exception as exc:
            self._error = exc
        except BaseException:
            # Cancelled from outside the worker: a caller still reading must
            # not see its stream end as if normally.
            if not self._consumer_gone:
                self._error = EngineShutdown("the worker's tasks were cancelled")
            raise
        finally:
            # Closing it ends the caller's stream (a synchronous close: no
            # checkpoint per pump when a thousand are cancelled at once).
            self._send.close()
        return False
