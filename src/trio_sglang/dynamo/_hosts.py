"""Where the trio side runs: as a guest on the runtime's uvloop, or over trio-asyncio.

Dynamo's runtime is asyncio: it calls the endpoint's handler on its event
loop and its own awaitables (registration, serving) must be awaited there.
The worker is trio. The two ways of ``_asyncio_bridge/_asyncio_side.py`` put both in one
thread: ``guest`` (the default), uvloop as the host and trio its guest;
``trio-asyncio``, trio as the host. With ``guest`` an ``SGLangEngine`` runs
SGLang's code on the runtime's loop too (``open_engine(asyncio_loop=)``).

The trio side owns everything in both (``serve_dynamo_worker`` is a trio
function); a host gives it the loop and one way to await an asyncio
awaitable. Handlers reach trio only through ``TrioToken.run_sync_soon``,
which both hosts allow from any asyncio callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from .._asyncio_bridge._asyncio_side import (
    LOOP_KINDS,
    AsyncioSide,
    LoopKind,
    guest_side,
    open_trio_asyncio_side,
)
from .._asyncio_bridge._guest import run_beside_asyncio

__all__ = ["HOSTS", "AsyncioHost", "HostKind", "run_hosted"]

T = TypeVar("T")

HostKind = LoopKind
HOSTS: tuple[HostKind, ...] = LOOP_KINDS


class AsyncioHost(Protocol):
    """What the trio side needs of the asyncio side it shares a thread with."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the runtime is built on and calls handlers on."""
        ...

    @property
    def kind(self) -> HostKind:
        """How trio shares the thread with it."""
        ...

    async def aio(self, call: Callable[[], Awaitable[T]]) -> T:
        """Await ``call()`` in an asyncio task, from trio; a trio cancel cancels it."""
        ...


class _Host:
    """An ``AsyncioSide`` as the runtime's host."""

    __slots__ = ("_side",)

    def __init__(self, side: AsyncioSide) -> None:
        self._side = side

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._side.loop

    @property
    def kind(self) -> HostKind:
        return self._side.kind

    async def aio(self, call: Callable[[], Awaitable[T]]) -> T:
        return await self._side.call(call)


def run_hosted(kind: HostKind, main: Callable[[AsyncioHost], Awaitable[T]]) -> T:
    """``main(host)``, run in trio beside an asyncio loop of the given kind; its result."""
    if kind not in HOSTS:
        raise ValueError(f"unknown host {kind!r}: one of {', '.join(HOSTS)}")
    result: T = run_beside_asyncio(kind, _hosted, main)
    return result


async def _hosted(
    loop: asyncio.AbstractEventLoop | None, main: Callable[[AsyncioHost], Awaitable[T]]
) -> T:
    if loop is not None:
        return await main(_Host(guest_side(loop)))
    # On this loop by name: an engine opens its own trio-asyncio loop inside the worker,
    # which closes with the engine, before the runtime does.
    async with open_trio_asyncio_side() as side:
        return await main(_Host(side))
