"""A hosted app's streamed chunks, written at once by ``serve``'s own connection (``SendNow``).

SGLang's application runs on another event loop in the server's thread. Each
chunk of a response it streams goes out as soon as it has it, when the
socket takes it (``ClientConnection.send_body_now``), rather than through a
trio task of its own; what the socket does not take goes the usual way,
where the connection's bounds hold. Judged over loopback, with a real
``serve`` and raw clients, and a hosted app of the test's own that sends as
``serve --engine sglang``'s does: at once where it can, else through ``send``.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any

import h11
import httpx
import trio
import trio.testing

import trio_sglang as ts
from trio_sglang._hosted_app import SEND_NOW_KEY, HostedApp
from trio_sglang.server import ServerLimits, serve

#: A small receive buffer, set before connect: a client that reads nothing takes
#: little of a response before the server's writes stop.
SMALL_RCVBUF = 4096
DONE = b"data: [DONE]\n\n"
STALLED = 'trio_sglang_clients_dropped_total{reason="stalled"} 1.0'


class Streaming:
    """A hosted app streaming ``chunks`` as SSE, each at once where it can go."""

    keeps_metrics = False
    no_transfer_host = None

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.at_once = 0
        self.handed = 0
        self.first_sent = trio.Event()
        self.finished = False
        #: Set however the app ends: finished, or cancelled (its client gone).
        self.ended = trio.Event()

    def metrics(self) -> bytes:
        return b""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self._stream(scope, receive, send)
        finally:
            self.ended.set()

    async def _stream(self, scope: Any, receive: Any, send: Any) -> None:
        await receive()
        send_now: Callable[[Any], bool] = scope[SEND_NOW_KEY]
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for chunk in self.chunks:
            message = {"type": "http.response.body", "body": chunk, "more_body": True}
            if send_now(message):
                self.at_once += 1
            else:
                self.handed += 1
                await send(message)
            self.first_sent.set()
        await send({"type": "http.response.body", "body": DONE})
        self.finished = True


class HostingSim(ts.SimEngine):
    """The SimEngine with an HTTP application of its own, as ``SGLangEngine`` has SGLang's."""

    def __init__(self, app: HostedApp) -> None:
        super().__init__()
        self._app = app

    def hosted_app(
        self, served_at: Callable[[], str | None]
    ) -> AbstractAsyncContextManager[HostedApp]:
        @asynccontextmanager
        async def opened() -> AsyncIterator[HostedApp]:
            yield self._app

        return opened()


@asynccontextmanager
async def serving(app: Streaming, **limits: Any) -> AsyncIterator[str]:
    """``serve`` hosting ``app`` on a free loopback port, for the block; its URL."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        start = partial(
            serve,
            HostingSim(app),
            port=0,
            handle_signals=False,
            shutdown=stop,
            host_app=True,
            limits=ServerLimits(**limits),
        )
        [url] = await nursery.start(start)
        try:
            yield url
        finally:
            stop.set()


async def connected(url: str) -> trio.SocketStream:
    """A raw client with a small receive window, its request to the hosted app sent."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RCVBUF)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    request = b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    await stream.send_all(request + b"content-length: 2\r\n\r\n{}")
    return stream


async def read_response(stream: trio.SocketStream) -> bytes:
    """The whole body, parsed by h11 as a client: a framing error fails the test."""
    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method="POST", target="/generate", headers=[("host", "t")]))
    body = bytearray()
    while True:
        event = parser.next_event()
        if event is h11.NEED_DATA:
            parser.receive_data(await stream.receive_some(1 << 16))
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return bytes(body)


async def test_a_streamed_chunk_the_socket_takes_goes_out_at_once_in_order() -> None:
    app = Streaming([b"data: %d\n\n" % i for i in range(50)])
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        answer = await client.post("/generate", json={})
    assert answer.status_code == 200
    assert answer.content == b"".join(app.chunks) + DONE
    assert (app.at_once, app.handed) == (50, 0)


async def test_what_the_socket_takes_in_part_goes_first_at_the_next_write() -> None:
    # Chunks far larger than the connection's buffers, while the client reads
    # nothing: the first goes out in part; the rest of it must precede every
    # byte after it, whichever way those go.
    app = Streaming([bytes([65 + i]) * (4 << 20) for i in range(3)])
    async with serving(app) as url:
        stream = await connected(url)
        async with stream:
            with trio.fail_after(10):
                await app.first_sent.wait()
                body = await read_response(stream)
    assert body == b"".join(app.chunks) + DONE
    assert app.at_once == 1  # in part: the rest went with the next write
    assert app.handed == 2


async def test_a_client_that_takes_nothing_is_dropped_though_its_chunks_go_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = Streaming([b"data: " + b"x" * 1000 + b"\n\n"] * 10_000)
    async with serving(app, client_stall_timeout=5.0) as url:
        stream = await connected(url)
        async with stream:
            with trio.fail_after(60):
                await app.ended.wait()  # the stalled client dropped, its route cancelled
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                metrics = (await client.get("/metrics")).text
    assert STALLED in metrics
    assert app.at_once > 0
    assert not app.finished
