"""``Handoff`` between trio and code on trio-asyncio's loop, and the hosted app's ``send`` on it.

The asyncio side never waits through a trio task of its own, only on a
future its handoff resolves, and it is never left waiting for an item or a
slot that came. trio-asyncio keeps asyncio's time on trio's clock, so the
waits below run on the autojump clock. Marked ``sglang``: trio-asyncio is
installed where SGLang is (importing it changes asyncio's event loop policy
for the whole process, which the unit suite's Dynamo tests must not meet).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

pytest.importorskip("trio_asyncio", reason="needs the asyncio extra")

import trio
import trio_asyncio
from trio.testing import MockClock

from trio_sglang._asyncio_bridge._handoff import Handoff, aio_receive, aio_send
from trio_sglang._sglang._server_app import _SGLangApp

pytestmark = pytest.mark.sglang


@asynccontextmanager
async def asyncio_loop() -> AsyncIterator[None]:
    """trio-asyncio's loop, for a test that fails rather than hangs if a side is never woken."""
    with trio.fail_after(10):
        async with trio_asyncio.open_loop():
            yield


def in_asyncio(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    wrapped: Callable[..., Awaitable[Any]] = trio_asyncio.aio_as_trio(fn)
    return wrapped


async def test_asyncio_code_reads_what_a_trio_task_sends_to_the_end(
    autojump_clock: MockClock,
) -> None:
    handoff: Handoff[int] = Handoff()

    async def produce() -> None:
        for n in range(5):
            await handoff.send(n)
            await trio.sleep(1)  # the reader waits on its future each time
        handoff.close()

    async def consume() -> list[int]:
        got = []
        while True:
            try:
                got.append(await aio_receive(handoff))
            except trio.EndOfChannel:
                return got

    async with asyncio_loop(), trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        assert await in_asyncio(consume)() == [0, 1, 2, 3, 4]


async def test_a_trio_task_reads_what_asyncio_code_sends_in_order(
    autojump_clock: MockClock,
) -> None:
    handoff: Handoff[int] = Handoff()
    received: list[int] = []

    async def produce() -> None:
        for n in range(5):
            await aio_send(handoff, n)  # waits while the last one is not taken
        handoff.close()

    async def consume() -> None:
        while True:
            try:
                received.append(await handoff.receive())
            except trio.EndOfChannel:
                return
            await trio.sleep(0.01)

    async with asyncio_loop(), trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await in_asyncio(produce)()
    assert received == [0, 1, 2, 3, 4]


async def test_an_asyncio_reader_cancelled_while_waiting_leaves_the_next_item_for_the_next() -> (
    None
):
    handoff: Handoff[str] = Handoff()

    async def read_within(seconds: float) -> str | None:
        try:
            return await asyncio.wait_for(aio_receive(handoff), seconds)
        except TimeoutError:
            return None

    async with asyncio_loop():
        assert await in_asyncio(read_within)(0.01) is None
        handoff.send_nowait("kept")  # wakes the cancelled reader's future: nothing breaks
        assert await in_asyncio(read_within)(1) == "kept"


async def test_a_hosted_apps_messages_are_sent_in_order_before_it_returns(
    autojump_clock: MockClock,
) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        await trio.sleep(0.001)  # a write that takes a moment: the app runs ahead by one
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for n in range(4):
            await send({"type": "http.response.body", "body": b"%d" % n, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async with asyncio_loop():
        await _SGLangApp(in_asyncio(app), False, "fake")({"type": "http"}, _nothing, send)
    assert [m.get("body") for m in sent] == [None, b"0", b"1", b"2", b"3", b""]


async def test_a_send_that_fails_fails_the_hosted_apps_next_send(autojump_clock: MockClock) -> None:
    raised: list[BaseException] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            raise OSError("the connection broke")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        try:
            while True:  # the failed write's outbox is closed: a send fails within two
                await send({"type": "http.response.body", "body": b"b", "more_body": True})
                await asyncio.sleep(0.01)
        except OSError as exc:
            raised.append(exc)

    async with asyncio_loop():
        await _SGLangApp(in_asyncio(app), False, "fake")({"type": "http"}, _nothing, send)
    assert [str(exc) for exc in raised] == ["the response could not be sent"]
    assert str(raised[0].__cause__) == "the connection broke"


async def test_a_failed_send_the_hosted_app_never_meets_is_raised_when_it_returns(
    autojump_clock: MockClock,
) -> None:
    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            raise OSError("the connection broke")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"all of it"})

    async with asyncio_loop():
        with pytest.raises(OSError, match="the connection broke"):
            await _SGLangApp(in_asyncio(app), False, "fake")({"type": "http"}, _nothing, send)


async def _nothing() -> dict[str, Any]:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


async def test_a_hosted_app_that_fails_raises_its_own_error_once_its_messages_are_sent(
    autojump_clock: MockClock,
) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        await trio.sleep(1)
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("the route failed")

    async with asyncio_loop():
        with pytest.raises(RuntimeError, match="the route failed"):  # not in a group
            await _SGLangApp(in_asyncio(app), False, "fake")({"type": "http"}, _nothing, send)
    assert [m["type"] for m in sent] == ["http.response.start"]


async def test_a_hosted_app_whose_client_stops_reading_holds_one_message_and_stops_when_told(
    autojump_clock: MockClock,
) -> None:
    handed: list[int] = []
    cancelled: list[bool] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await trio.sleep_forever()  # the client takes nothing; the server's bound ends it

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            for n in range(100):
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
                handed.append(n)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async with asyncio_loop():
        with trio.move_on_after(5) as bound:  # the server's stall bound, as it cancels
            await _SGLangApp(in_asyncio(app), False, "fake")({"type": "http"}, _nothing, send)
    assert bound.cancelled_caught
    assert handed == [0, 1]  # one being written, one waiting in the outbox, no more
    assert cancelled == [True]
