"""``Handoff``: one item at a time between a trio task and asyncio code in the same thread.

On either asyncio side (``_asyncio_bridge/_asyncio_side.py``) every asyncio callback runs in
trio's thread, so asyncio code may call trio's synchronous operations; what
it cannot do cheaply is *await* trio. Each such call (``TrioCalls``) is a
trio task of its own and a future, and on trio-asyncio's loop turns of that
loop, each a trio checkpoint and a cancel scope. A hosted route streaming a
response would pay that twice per chunk (the engine's output in, the event
out), the largest cost of ``serve --engine sglang`` per token.

A ``Handoff`` holds at most one item. A trio task awaits its ``send`` or
``receive``, as on a memory channel of capacity one. The other side calls
``send_nowait`` or ``receive_nowait`` and, on ``trio.WouldBlock``, asks to be
told when to try again (``when_changed``): a plain callback, which an asyncio
caller turns into a future of its own loop (``aio_receive``, ``aio_send``). A turn
of the other loop is then spent only where a side really waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import trio

__all__ = ["Handoff", "Receiving", "aio_receive", "aio_send"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Receiving(Protocol[T_co]):
    """A handoff's consumer side, as code on another loop uses it (``aio_receive``)."""

    def receive_nowait(self) -> T_co: ...

    def when_changed(self, callback: Callable[[], None]) -> None: ...


class Handoff(Generic[T]):
    """One item at a time from one producer to one consumer; see the module."""

    __slots__ = ("_callbacks", "_closed", "_item", "_lot")

    def __init__(self) -> None:
        self._item: list[T] = []  # empty, or the one item
        self._closed = False
        self._lot = trio.lowlevel.ParkingLot()
        self._callbacks: list[Callable[[], None]] = []

    def send_nowait(self, item: T) -> None:
        """Hand ``item`` over; ``trio.WouldBlock`` while the last one is not taken yet."""
        if self._closed:
            raise trio.ClosedResourceError("the handoff is closed")
        if self._item:
            raise trio.WouldBlock
        self._item.append(item)
        self._changed()

    def receive_nowait(self) -> T:
        """The item; ``trio.WouldBlock`` if none is there, ``trio.EndOfChannel`` once closed."""
        if self._item:
            item = self._item.pop()
            self._changed()
            return item
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    def close(self) -> None:
        """No more items: the consumer takes the one left, if any, then meets the end."""
        if not self._closed:
            self._closed = True
            self._changed()

    def when_changed(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once, at the next send, receive or close (from that side's code)."""
        self._callbacks.append(callback)

    async def send(self, item: T) -> None:
        """``send_nowait``, waiting for the last item to be taken (a trio checkpoint)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            try:
                self.send_nowait(item)
            except trio.WouldBlock:
                await self._lot.park()
                waited = True
            else:
                if not waited:  # the wait was this call's schedule point, if there was one
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return

    async def receive(self) -> T:
        """``receive_nowait``, waiting for an item or the close (a trio checkpoint)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            try:
                item = self.receive_nowait()
            except trio.WouldBlock:
                await self._lot.park()
                waited = True
            else:
                if not waited:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return item

    def _changed(self) -> None:
        self._lot.unpark_all()
        if self._callbacks:
            callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                callback()


async def aio_receive(handoff: Receiving[T]) -> T:
    """asyncio: ``handoff``'s next item (``trio.EndOfChannel`` at its end)."""
    while True:
        try:
            return handoff.receive_nowait()
        except trio.WouldBlock:
            await _changed(handoff.when_changed)


async def aio_send(handoff: Handoff[T], item: T) -> None:
    """asyncio: hand ``item`` over, once the last one is taken."""
    while True:
        try:
            handoff.send_nowait(item)
        except trio.WouldBlock:
            await _changed(handoff.when_changed)
        else:
            return


async def _changed(when_changed: Callable[[Callable[[], None]], None]) -> None:
    """asyncio: a handoff's next change, as a future of the running loop."""
    changed = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not changed.done():  # a caller cancelled meanwhile has its answer
            changed.set_result(None)

    when_changed(wake)
    await changed
