"""Where SGLang's asyncio code runs beside the trio worker, and how each side awaits the other.

SGLang (and Dynamo's runtime) is asyncio code; the worker is trio. Both run
in one thread, in one of two ways (``LoopKind``):

- ``guest``: an asyncio loop (uvloop where installed) is the host and trio
  runs as its guest (``trio.lowlevel.start_guest_run``, ``run_as_guest``).
  asyncio code runs at the loop's own speed, and its callbacks run in trio's
  thread between trio's turns, so they may wake trio tasks directly: trio's
  runner then takes a turn as soon as it can.
- ``trio-asyncio``: trio is the host, and trio-asyncio's loop runs the
  asyncio code inside the trio run (``open_trio_asyncio_side``). Every call
  across costs a trio task, a future and turns of that loop.

An ``AsyncioSide`` is what trio code needs of either: the loop, and ``call``,
which awaits an asyncio coroutine function from trio, owned by the trio call
(a cancel cancels it and waits for it to finish). ``TrioCalls`` is the other
direction: asyncio code awaiting trio, each call a task of a nursery that
owns it, started through the run's ``TrioToken``, which both hosts allow.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol, TypeVar

import trio

__all__ = [
    "CANCEL_GRACE",
    "LOOP_KINDS",
    "AsyncioSide",
    "LoopKind",
    "TrioCalls",
    "guest_side",
    "open_trio_asyncio_side",
    "trio_asyncio",
]

T = TypeVar("T")

LoopKind = Literal["guest", "trio-asyncio"]
LOOP_KINDS: tuple[LoopKind, ...] = ("guest", "trio-asyncio")

#: Seconds a cancelled call across gets to finish its own cancellation (SGLang's
#: release path runs there) before the trio side stops waiting for it.
CANCEL_GRACE = 5.0


class AsyncioSide(Protocol):
    """The asyncio loop beside the trio run, and how trio awaits code on it."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def kind(self) -> LoopKind: ...

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` in an asyncio task on ``loop``; a trio cancel cancels it."""
        ...


def trio_asyncio() -> Any:
    """The ``trio_asyncio`` module, or an ``ImportError`` that says where it comes from."""
    try:
        import trio_asyncio as module
    except ImportError as exc:
        raise ImportError(
            "SGLang's asyncio code runs inside trio on trio-asyncio's loop (an SGLangEngine "
            "without asyncio_loop=, --loop trio-asyncio), and trio-asyncio is not installed: "
            "pip install 'trio-sglang[asyncio]', or run trio as the guest of asyncio "
            "(trio_sglang.run_as_guest and asyncio_loop=, --loop guest)"
        ) from exc
    return module


class _GuestSide:
    """The host loop trio is the guest of: a call is an asyncio task the trio call owns."""

    __slots__ = ("_loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def kind(self) -> LoopKind:
        return "guest"

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        # A cancel already pending: the task would start before trio delivers it.
        await trio.lowlevel.checkpoint_if_cancelled()
        task = self._loop.create_task(_awaited(fn, *args))
        # The engine's every output comes through here: the trio task parks on trio's
        # lowest wait, which the task's done callback (run by the host loop, in trio's
        # thread) ends, rather than on an Event made for each call.
        waiter = trio.lowlevel.current_task()
        parked = True

        def wake(_: object) -> None:
            if parked:
                trio.lowlevel.reschedule(waiter)

        def abort(_: object) -> trio.lowlevel.Abort:
            nonlocal parked
            parked = False
            return trio.lowlevel.Abort.SUCCEEDED

        task.add_done_callback(wake)
        try:
            await trio.lowlevel.wait_task_rescheduled(abort)
        finally:
            if not task.done():
                finished = trio.Event()
                task.add_done_callback(lambda _: finished.set())
                task.cancel()
                with trio.move_on_after(CANCEL_GRACE, shield=True):
                    await finished.wait()
            if task.done() and not task.cancelled():
                task.exception()  # retrieved, for a caller cancelled meanwhile
        return task.result()


class _TrioAsyncioSide:
    """trio-asyncio's loop inside the trio run: a call goes through ``aio_as_trio``.

    On this loop by name: a trio task finds as its current loop the innermost
    one opened around where it was started, which need not be this one.
    """

    __slots__ = ("_call", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._call = trio_asyncio().aio_as_trio(_awaited, loop=loop)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def kind(self) -> LoopKind:
        return "trio-asyncio"

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        result: T = await self._call(fn, *args)
        return result


async def _awaited(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``fn(*args)`` awaited in a coroutine: a task needs one, and ``fn`` runs only if it starts."""
    return await fn(*args)


def guest_side(loop: asyncio.AbstractEventLoop) -> AsyncioSide:
    """The side of the host ``loop`` this trio run is the guest of (``run_as_guest``)."""
    if not loop.is_running():
        raise RuntimeError("the asyncio loop given is not running: trio must be its guest")
    return _GuestSide(loop)


@asynccontextmanager
async def open_trio_asyncio_side() -> AsyncIterator[AsyncioSide]:
    """A trio-asyncio loop inside this trio run, for the block."""
    async with trio_asyncio().open_loop() as loop:
        yield _TrioAsyncioSide(loop)


class TrioCalls:
    """asyncio code awaiting trio: each call a task of ``nursery``, cancelled both ways.

    An asyncio caller cancelled cancels the trio task; the nursery cancelled
    cancels the asyncio caller (``CancelledError``). What the trio function
    raises reaches the caller, and never the nursery.
    """

    __slots__ = ("_nursery", "_token")

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._token = trio.lowlevel.current_trio_token()

    async def __call__(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """asyncio: ``await fn(*args)`` in trio."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        scope = trio.CancelScope()

        def cancel_if_cancelled(future: asyncio.Future[T]) -> None:
            if future.cancelled():
                # The trio run may have ended first (its host loop then cancels what is left).
                with contextlib.suppress(trio.RunFinishedError):
                    self._token.run_sync_soon(scope.cancel)

        done.add_done_callback(cancel_if_cancelled)
        self._token.run_sync_soon(self._start, done, scope, fn, args)
        return await done

    def _start(
        self,
        done: asyncio.Future[T],
        scope: trio.CancelScope,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
    ) -> None:
        try:
            self._nursery.start_soon(_settled, done, scope, fn, args)
        except RuntimeError:  # the nursery closed meanwhile: over before it began
            if not done.done():
                done.cancel()


async def _settled(
    done: asyncio.Future[T],
    scope: trio.CancelScope,
    fn: Callable[..., Awaitable[T]],
    args: tuple[Any, ...],
) -> None:
    """trio: ``fn(*args)``, its outcome put in ``done`` (``done`` cancelled, it is cancelled)."""
    with scope:
        try:
            result = await fn(*args)
        except Exception as exc:  # the caller's to meet
            if not done.done():
                done.set_exception(exc)
        except BaseException:  # trio.Cancelled and the like: the caller is cancelled too
            if not done.done():
                done.cancel()
            raise
        else:
            if not done.done():
                done.set_result(result)
