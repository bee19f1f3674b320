"""Where the trio side runs: as a guest on the runtime's uvloop, or over trio-asyncio.

Dynamo's runtime is asyncio: it calls the endpoint's handler on its event
loop and its own awaitables (registration, serving) must be awaited there.
The worker is trio. Two ways put both in one thread:

- ``guest`` (the default): uvloop is the host, and trio runs as its guest
  (``trio.lowlevel.start_guest_run``). asyncio code runs at full uvloop speed;
  trio's I/O waits in a helper thread between its turns.
- ``trio-asyncio``: trio is the host, and trio-asyncio's loop runs the
  runtime's asyncio code as trio tasks. What the SGLang engine uses anyway,
  so the one to pick with ``--engine sglang``.

The trio side owns everything in both (``serve_dynamo_worker`` is a trio
function); a host gives it the loop and one way to await an asyncio
awaitable. Handlers reach trio only through ``TrioToken.run_sync_soon``,
which both hosts allow from any asyncio callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, TypeVar

import trio

__all__ = ["HOSTS", "AsyncioHost", "HostKind", "run_hosted"]

T = TypeVar("T")

HostKind = Literal["guest", "trio-asyncio"]
HOSTS: tuple[HostKind, ...] = ("guest", "trio-asyncio")

#: How long a cancelled asyncio call gets to finish its own cancellation.
_CANCEL_GRACE = 5.0


class AsyncioHost(Protocol):
    """What the trio side needs of the asyncio side it shares a thread with."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the runtime is built on and calls handlers on."""
        ...

    async def aio(self, call: Callable[[], Awaitable[T]]) -> T:
        """Await ``call()`` in an asyncio task, from trio; a trio cancel cancels it."""
        ...


class _LoopHost:
    """The asyncio loop both hosts run the runtime on."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop


class _GuestHost(_LoopHost):
    """trio as a guest of a uvloop: an asyncio call is an asyncio task this trio call owns."""

    async def aio(self, call: Callable[[], Awaitable[T]]) -> T:
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        # Owned here, not fired and forgotten: this call waits for the task
        # and, if cancelled, cancels it and waits for it to finish.
        task = self._loop.create_task(_awaited(call))
        task.add_done_callback(lambda _: token.run_sync_soon(finished.set))
        try:
            await finished.wait()
        finally:
            if not task.done():
                task.cancel()
                with trio.move_on_after(_CANCEL_GRACE, shield=True):
                    await finished.wait()
        return task.result()


class _TrioAsyncioHost(_LoopHost):
    """trio-asyncio's loop inside the trio run: an asyncio call is awaited through it.

    On this loop by name: a trio task finds as its current loop the innermost
    one opened around where it was started, and ``SGLangEngine`` opens one of
    its own inside the worker; the runtime's calls must not end up on that one,
    which closes with the engine, before the runtime does.
    """

    async def aio(self, call: Callable[[], Awaitable[T]]) -> T:
        import trio_asyncio

        result: T = await trio_asyncio.aio_as_trio(_awaited, loop=self._loop)(call)
        return result


async def _awaited(call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` awaited in a coroutine: the runtime's futures need a running asyncio task."""
    return await call()


def run_hosted(kind: HostKind, main: Callable[[AsyncioHost], Awaitable[T]]) -> T:
    """``main(host)``, run in trio beside an asyncio loop of the given kind; its result."""
    if kind == "guest":
        return _run_as_guest(main)
    if kind == "trio-asyncio":
        return trio.run(_over_trio_asyncio, main)
    raise ValueError(f"unknown host {kind!r}: one of {', '.join(HOSTS)}")


async def _over_trio_asyncio(main: Callable[[AsyncioHost], Awaitable[T]]) -> T:
    import trio_asyncio

    async with trio_asyncio.open_loop() as loop:
        return await main(_TrioAsyncioHost(loop))


def _run_as_guest(main: Callable[[AsyncioHost], Awaitable[T]]) -> T:
    import uvloop  # the runtime's own loop (a dependency of ai-dynamo-runtime)

    async def host() -> T:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        trio.lowlevel.start_guest_run(
            main,
            _GuestHost(loop),
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=done.set_result,
            # uvloop owns the signal wake-up fd; trio's signal receivers still
            # work through their handlers, which uvloop runs promptly.
            host_uses_signal_set_wakeup_fd=True,
        )
        # The guest run ends only when main returns; main bounds its own shutdown.
        outcome = await done
        result: T = outcome.unwrap()
        return result

    result: T = uvloop.run(host())
    return result
