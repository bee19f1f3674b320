"""One request's life, from its block's start to its last cleanup task: ``ResponseStream``.

The caller's stream is the request: one object from ``Worker.generate`` to
the last task of its cleanup. Everything that moves a request's ``State``
lives in this file, and the moves are data (``_NEXT``), as in h11's
``_state.py``: an event the table does not list for a state is a bug in
this file, raised at once, never absorbed.

The block (``async with worker.generate(...)``) is the request's cancel
scope: entering it checks the request (``InvalidRequest`` before anything
reaches the engine), mints its engine rids and binds the scope to the
caller's ``RequestContext``, so that ``ctx.stop()``/``ctx.kill()`` and the
worker's shutdown cancel it; leaving it, however, makes the request leave.

Two tasks move the state. The caller's task pulls, and leaves however it
leaves (cancelled, failed, closed, its block ended). A request whose
caller's task cannot read the engine stream itself also has a reader in the
worker's ``CleanupGroup`` (``_read_for_caller``), which hands each output
over through a zero-buffer channel, the same back-pressure as reading
directly. Two kinds of request need one:

- parallel sampling (``n > 1``): SGLang swaps every child rid for a fresh
  uuid that only the child's first output reveals, and has no group abort,
  so after the caller goes someone must keep reading to learn the children
  that have not spoken yet;
- any request on an engine whose close does not release it
  (``release_on_close`` false): cancelling the caller's pull would kill the
  generator before dispatch and leave the request registered for ever, so
  the generator has to keep running until the request is dispatched, and
  the abort follows the dispatch.

The reader moves the state only to ``FINISHED``, and before its channel
closes, so that a caller who then sees the end does not count it as
leaving early. When the engine fails under it, it leaves the state
``OPEN``: the caller must still take the error at its next pull.

Once the caller has gone, what still has to be awaited is the request's
``Cleanup`` (``_cleanup.py``), made then, and only if the engine may still
hold the request: it closes the engine stream (SGLang's own release path)
and falls back on the ordered abort, in tasks of the worker's
``CleanupGroup``, and says when its last task has ended.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Awaitable, Mapping
from types import TracebackType
from typing import Any

import trio

from .._engine import EngineStream
from .._errors import EngineError, EngineShutdown, InvalidRequest
from .._request._parse import OutputMode
from ._cleanup import Cleanup
from ._context import RequestContext, attach, detach
from ._disagg import PrefillLeg, new_bootstrap
from ._outputs import PublicIds, format_chunk
from ._reports import describe
from ._shared import Shared

__all__ = ["Event", "ResponseStream", "State"]

logger = logging.getLogger("trio_sglang")


class State(enum.Enum):
    """Where one request is in its life."""

    # The transition table's keys: hashed by identity, at C speed (an Enum's
    # own hash is Python code).
    __hash__ = object.__hash__

    #: Made, its block perhaps entered: nothing pulled, nothing at the engine.
    NEW = "new"
    #: The caller reads it (itself, or through the reader).
    OPEN = "open"
    #: The engine stream ended by itself: nothing is owed.
    FINISHED = "finished"
    #: The caller went before the end: the engine side is being stopped.
    LEFT = "left"
    #: Stopped: no task works on it any more.
    DONE = "done"


class Event(enum.Enum):
    """What moves a request's ``State``."""

    __hash__ = object.__hash__

    #: The caller's first pull.
    PULL = "the first pull"
    #: The engine stream ended by itself.
    END = "the engine stream ended"
    #: The caller went, however it went.
    LEAVE = "the caller left"
    #: The last task at work on the request's engine side ended.
    STOPPED = "the engine side stopped"


# The pull is the hot path (one call per token), and looking up an enum
# member costs a class attribute access (~50 ns) where a global costs ~10.
_NEW, _OPEN, _FINISHED, _LEFT, _DONE = State
_PULL, _END, _LEAVE, _STOPPED = Event

#: No engine ids: one immutable empty set, shared (a request that needs none costs the
#: collector no object; most requests never see an abort by id).
_NO_IDS: frozenset[str] = frozenset()

#: Every move a request can make.
_NEXT: dict[tuple[State, Event], State] = {
    (_NEW, _PULL): _OPEN,
    (_NEW, _LEAVE): _DONE,  # nothing reached the engine
    (_OPEN, _END): _FINISHED,
    (_OPEN, _LEAVE): _LEFT,
    # The reader stopped a failed engine stream before its caller took the error.
    (_OPEN, _STOPPED): _OPEN,
    (_FINISHED, _END): _FINISHED,  # the reader saw the end first, then its caller
    (_FINISHED, _LEAVE): _FINISHED,
    (_LEFT, _LEAVE): _LEFT,
    (_LEFT, _STOPPED): _DONE,
    (_DONE, _LEAVE): _DONE,
}


class ResponseStream:
    """The caller's stream: ``async with worker.generate(...) as chunks``, then ``async for``.

    Chunk dicts, with public ids only; see the module's docstring.
    """

    __slots__ = (
        "_children_unknown",
        "_ctx",
        "_error",
        "_has_reader",
        "_output",
        "_pull_scope",
        "_reading",
        "_receive",
        "_request",
        "_send",
        "_shared",
        "children",
        "cleanup",
        "ids",
        "leg",
        "pulling",
        "rids",
        "scope",
        "state",
        "stream",
    )

    def __init__(
        self, shared: Shared, request: object, ctx: RequestContext, output: OutputMode
    ) -> None:
        """``request``: a body, or what ``Worker.prepare`` made of one; checked on entering."""
        self._shared = shared
        self._request = request
        self._ctx = ctx
        self._output: OutputMode = output
        self.state = _NEW
        #: Whether the caller is inside a pull (another task's ``aclose`` must cancel it).
        self.pulling = False
        #: A decode request's prefill leg, under ``scope``.
        self.leg: PrefillLeg | None = None
        #: The engine side's stopping, from the caller's leaving (or the engine's
        #: failure under the reader) to its last task; none while nothing is owed.
        self.cleanup: Cleanup | None = None

    # -- the block ------------------------------------------------------------

    async def __aenter__(self) -> ResponseStream:
        if hasattr(self, "stream"):
            raise RuntimeError("a generate() block is entered once")
        self._open()
        self.scope.__enter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        try:
            swallowed = self.scope.__exit__(exc_type, exc, traceback)
        finally:
            self._close_block()
        if exc is not None and not swallowed:
            return False  # the body's own error goes on
        error = self._block_error()
        if error is not None:
            raise error from error.__cause__  # the prefill's failure, or nothing
        return swallowed

    def _open(self) -> None:
        """The block's start: the request checked, sent to the engine, bound to its context."""
        shared = self._shared
        parsed, prefill_leg = shared.check(self._request, self._output)
        ctx = self._ctx
        if not isinstance(ctx, RequestContext):
            raise InvalidRequest(f"ctx must be a RequestContext, got {type(ctx).__name__}")
        bootstrap: Mapping[str, Any] = {}
        if prefill_leg:
            assert shared.prefill is not None  # a prefill leg needs the worker's peer
            bootstrap = new_bootstrap(shared.prefill)
        if shared.blocks.closed:
            raise EngineShutdown("the worker is shutting down")
        rids = parsed.mint_rids()
        self._start(
            shared.engine.generate({**parsed.engine_request(rids), **bootstrap}),
            PublicIds.for_request(parsed, ctx.id),
            rids if parsed.stable_ids else (),
        )
        if prefill_leg:
            assert shared.prefill is not None
            self.leg = PrefillLeg(
                shared.prefill,
                {**parsed.body, **bootstrap},
                self.ids.request,
                rids,
                self.scope,
                shared.reports,
                cancel_anytime=shared.prefill_cancel_anytime,
                cleanup_timeout=shared.policy.cleanup_timeout,
            )
        shared.blocks.add(self.scope)
        attach(ctx, self.scope)

    def _start(self, stream: EngineStream, ids: PublicIds, rids: tuple[str, ...]) -> None:
        """The request at the engine: ``rids`` are the engine ids known before it starts, or
        none for parallel sampling, whose children SGLang names only in their first outputs."""
        #: The caller's block: ``ctx.stop()``, the shutdown and a failed prefill cancel it.
        self.scope = trio.CancelScope()
        self.stream = stream
        self.ids = ids
        #: Engine ids known before the request started (one, or one per prompt).
        self.rids = rids
        #: Engine ids first seen in outputs (``n > 1``), mapped to "finished".
        self.children: dict[str, bool] = {}
        self._children_unknown = not rids
        self._reading = False
        self._error: Exception | None = None
        self._has_reader = self._children_unknown or not self._shared.release_on_close
        if self._has_reader:
            self._send, self._receive = trio.open_memory_channel[dict[str, Any]](0)
            # Unbounded while the caller reads; from its leaving, bounded by
            # the watch in ``leave`` and the request's cleanup deadline.
            self._pull_scope = trio.CancelScope()

    def _close_block(self) -> None:
        """The block's end, however it ends: the stream closed, both legs stopped."""
        detach(self._ctx, self.scope)
        self.end_block()
        self._shared.blocks.discard(self.scope)

    def _block_error(self) -> Exception | None:
        """What leaving a block that ended without an error of its own raises, if anything."""
        failure = self.prefill_error
        if failure is not None:
            error = EngineError(
                f"the prefill of {self.ids.request} failed ({type(failure).__name__})"
            )
            error.__cause__ = failure
            return error
        if self._shared.blocks.closed and self.scope.cancelled_caught:
            return EngineShutdown("the worker shut down while the stream was open")
        return None

    def _entered(self) -> None:
        if not hasattr(self, "stream"):
            raise RuntimeError(
                "a stream is read inside its block: async with worker.generate(...) as chunks"
            )

    def _fire(self, event: Event) -> None:
        try:
            self.state = _NEXT[self.state, event]
        except KeyError:
            raise AssertionError(f"{event.value} in state {self.state.value}") from None

    # -- the caller's side ----------------------------------------------------

    @property
    def id(self) -> str:
        """The request's public id (text chunks carry it)."""
        self._entered()
        return self.ids.request

    @property
    def closed(self) -> bool:
        """Whether the caller's stream is over: finished, or left."""
        self._entered()
        return self.state is not _OPEN and self.state is not _NEW

    def __aiter__(self) -> ResponseStream:
        return self

    async def aclose(self) -> None:
        """End the stream now; the engine-side cleanup goes on in the worker."""
        self._entered()
        if self.pulling:
            # Another task is inside a pull: ending the block is the only way
            # to stop it at once (the pull itself then leaves).
            self.scope.cancel()
        else:
            self.leave()
        await trio.lowlevel.checkpoint()

    @property
    def prefill_error(self) -> Exception | None:
        """Why the request's prefill leg failed while the request was open, if it did."""
        return None if self.leg is None else self.leg.error

    async def __anext__(self) -> dict[str, Any]:
        """The caller's next chunk; ``StopAsyncIteration`` at the end."""
        state = self.state
        if state is not _OPEN:
            if state is not _NEW:
                raise StopAsyncIteration
            self._entered()
            # A stream whose context was stopped before its first pull must
            # not touch the engine at all.
            await trio.lowlevel.checkpoint_if_cancelled()
            self._start_engine_side()
        self.pulling = True
        try:
            if self._shared.stall_timeout is None:
                out = await self._next()
            else:
                out = await self._pull_within_stall_timeout(self._shared.stall_timeout)
        except StopAsyncIteration:
            self._fire(_END)
            raise
        except BaseException as exc:
            # Cancelled, failed or interrupted: the engine stream cannot
            # resume, so its cleanup starts now, not at block exit.
            failed = isinstance(exc, Exception) and not isinstance(
                exc, EngineError | EngineShutdown
            )
            error = self._failed(exc) if failed else None
            self.leave(pull_cancelled=isinstance(exc, trio.Cancelled))
            if error is not None:
                raise error from exc
            raise
        finally:
            self.pulling = False
        return format_chunk(self._output, out, self.ids)

    def _start_engine_side(self) -> None:
        """The first pull: the prefill leg and the reader start beside the caller."""
        self._fire(_PULL)
        if self.leg is not None:
            self._shared.group.start_soon(self.leg.run)
        if self._has_reader:
            self._reading = True
            self._shared.group.start_soon(self._read_for_caller)

    async def _pull_within_stall_timeout(self, stall_timeout: float) -> dict[str, Any]:
        with trio.move_on_after(stall_timeout):
            return await self._next()
        raise self._stalled()

    def leave(self, *, pull_cancelled: bool = False) -> None:
        """The caller has gone, however it went: the engine side is the worker's now.

        Both legs stop here, when the stream closes (a cancelled pull closes
        it while the block may stay open for long), not at block exit.
        Idempotent: a finished or left request does nothing more.
        """
        was = self.state
        self._fire(_LEAVE)
        if self._has_reader:
            self._receive.close()
        if was is not _OPEN:
            return
        if self.leg is not None:
            self.leg.end()
        if not self._has_reader:
            self._hand_over(pull_cancelled=pull_cancelled)
        elif self._reading and self.cleanup is None:
            self._reader_fails_closed()
        elif self.cleanup is None or not self.cleanup.working:
            # The reader has ended (a failed engine stream it already stopped,
            # or the shutdown's cut): nothing works on it any more.
            self._fire(_STOPPED)

    def end_block(self) -> None:
        """The caller's block has ended, however: leave, and end the prefill leg in any case.

        A stream that finished left its leg to this.
        """
        self.leave()
        if self.leg is not None:
            self.leg.end()

    def _hand_over(self, *, pull_cancelled: bool) -> None:
        """The caller of a stream it read itself has gone: stop the request at the engine.

        A cancelled pull ran the engine's release path; if the engine then
        holds none of the request's ids, there is nothing left to await (the
        usual case, and in a burst of cancels it spares a task per request).
        """
        abort_sent = _NO_IDS
        if pull_cancelled:
            rids = self.unfinished()
            still = self._shared.held(rids)
            if not still and self._shared.scheduler_done(rids):
                self._shared.reports.cleanup_finished(0.0, released=True)
                self._fire(_STOPPED)
                return
            if self._shared.release_aborts_once:
                abort_sent = frozenset(still)  # what it still holds was dispatched
        cleanup = self.cleanup = self._cleanup(abort_sent)
        if not cleanup.start(cleanup.stop):
            logger.warning(
                "request %s ended after the worker closed; the engine closed with it",
                self.ids.request,
            )

    def _failed(self, error: BaseException) -> EngineError:
        """The engine's stream raised ``error``: logged whole, and the caller's error."""
        self._shared.reports.fault(
            "stream_error", self.ids.request, self.unfinished(), describe(error), error=error
        )
        # The engine's own error may name internal ids: the caller gets its
        # type (and ``__cause__``), the log gets the whole of it.
        return EngineError(
            f"the engine failed while generating {self.ids.request} ({type(error).__name__})"
        )

    def _stalled(self) -> EngineError:
        """No output within ``stall_timeout``: logged with the engine's phases, and the error."""
        timeout = self._shared.policy.stall_timeout
        phases = ", ".join(self._shared.engine.phase(rid).value for rid in self.unfinished())
        self._shared.reports.fault(
            "stream_stalled",
            self.ids.request,
            self.unfinished(),
            f"no output for {timeout}s (engine phase: {phases or 'unknown'})",
        )
        return EngineError(f"the engine sent no output for {self.ids.request} in {timeout}s")

    # -- the reader, for a caller whose task cannot read the engine stream ----

    def _next(self) -> Awaitable[dict[str, Any]]:
        """The next engine output: from the reader, or the engine stream itself.

        Not a bound method kept per request: one tracked object fewer each.
        """
        return self._receive_from_reader() if self._has_reader else self.stream.__anext__()

    async def _receive_from_reader(self) -> dict[str, Any]:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            if self._error is not None:
                raise self._error from None
            raise StopAsyncIteration from None

    async def _read_for_caller(self) -> None:
        timed_out = False
        try:
            if not await self._read():
                # The engine failed (the caller gets its error), or the caller left.
                cleanup = self._fail_closed() if self.state is _OPEN else self.cleanup
                assert cleanup is not None  # made when the caller left
                with trio.move_on_at(cleanup.deadline) as scope:
                    await cleanup.stop()
                timed_out = scope.cancelled_caught
            if self.cleanup is not None:
                # Reading ran into the cleanup's deadline (a watch longer than cleanup_timeout).
                timed_out |= trio.current_time() >= self.cleanup.deadline
        finally:
            self._reading = False
            if self.cleanup is not None:  # it failed closed: its part of the cleanup ends
                self.cleanup.end(timed_out=timed_out)

    async def _read(self) -> bool:
        """Read until the engine stream ends (True), or stop early (False)."""
        ended = False
        try:
            with self._pull_scope:
                if self.state is _OPEN:  # else the caller left before the reader ran
                    async for out in self.stream:
                        child = self._note_child(out) if self._children_unknown else None
                        if self.state is _OPEN:
                            # BrokenResourceError: the caller left during the hand-over.
                            with contextlib.suppress(trio.BrokenResourceError):
                                await self._send.send(out)
                        elif child is not None and not self.children[child]:
                            cleanup = self.cleanup  # made when the caller left
                            assert cleanup is not None
                            cleanup.start(cleanup.ordered_abort, child)  # first seen after it
                    ended = True
        except Exception as exc:
            self._error = exc  # before the channel closes, so that the caller raises it
        except BaseException:
            # Cut by the worker's shutdown: a caller still reading must not
            # see its stream end as if normally.
            if self.state is _OPEN:
                self._error = EngineShutdown("the worker's tasks were cancelled")
            self._send.close()
            raise
        if ended and self.state is _OPEN:
            # Before the channel closes: a caller that sees the end now must
            # not count it as leaving early.
            self._fire(_END)
        # Closing it ends the caller's stream (a synchronous close: no
        # checkpoint per reader when a thousand are cancelled at once).
        self._send.close()
        return ended

    def _reader_fails_closed(self) -> None:
        """The caller left a request the reader reads: it reads on only to stop what it finds."""
        cleanup = self._fail_closed()
        if self._shared.release_on_close:
            self._pull_scope.cancel()  # the engine's release path stops every child
            return
        for rid in self.unfinished():
            cleanup.start(cleanup.ordered_abort, rid)
        watch = self._shared.policy.dispatch_timeout + self._shared.policy.release_timeout
        if self._children_unknown:
            watch = self._shared.policy.child_watch_timeout
        self._pull_scope.deadline = min(self._pull_scope.deadline, trio.current_time() + watch)

    def _fail_closed(self) -> Cleanup:
        """The reader's own part of the cleanup, made now: it reads on within its deadline."""
        cleanup = self.cleanup = self._cleanup(_NO_IDS)
        cleanup.begin()
        self._pull_scope.deadline = min(self._pull_scope.deadline, cleanup.deadline)
        return cleanup

    def _cleanup(self, abort_sent: frozenset[str]) -> Cleanup:
        """The engine side's stopping, owed from now (``_cleanup.py``)."""
        return Cleanup(self._shared, self, abort_sent)

    def stopped(self) -> None:
        """The last task of the cleanup has ended (``Cleanup.end``).

        The cleanup is let go here, so that the two, which name each other, go
        with their last reference, not at the collector's next pass.
        """
        self.cleanup = None
        self._fire(_STOPPED)

    # -- the request's engine ids ----------------------------------------------

    def _note_child(self, out: dict[str, Any]) -> str | None:
        """Record the output's engine id; return it when seen for the first time."""
        meta = out.get("meta_info") or {}
        rid = meta.get("id")
        if not isinstance(rid, str):
            return None
        new = rid not in self.children
        self.children[rid] = self.children.get(rid, False) or meta.get("finish_reason") is not None
        return rid if new else None

    def unfinished(self) -> list[str]:
        """Every engine id that may still be running: known ones and unfinished children."""
        return [*self.rids, *(rid for rid, done in self.children.items() if not done)]
