"""The one leaving client (``trio_sglang.bench_endpoint._clients``) that bench-endpoint's
visits and the load test's users share, against a raw loopback server that counts its
connections: what it reads, when it leaves, and when it keeps its connection for the next
request (the load test's users do; a leave or an early stop closes it). Real time, a few
milliseconds; every wait bounded.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import pytest
import trio

from trio_sglang.bench_endpoint._apis import request_body
from trio_sglang.bench_endpoint._clients import Stream, http_client, leave_when_sent, read_events

EVENTS = [b'data: {"text": "a"}', b": keep-alive", b'data: {"text": "b"}', b"data: [DONE]"]
ERROR_PAGE = b"x" * 300


@dataclass
class Server:
    url: str = ""
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        # A client that leaves with the answer unread in its socket resets the connection.
        with contextlib.suppress(trio.BrokenResourceError):
            await self._serve(stream)

    async def _serve(self, stream: trio.SocketStream) -> None:
        received = b""
        while data := await stream.receive_some():
            received += data
            while b"\r\n\r\n" in received:
                head, _, rest = received.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(rest) < length:
                    break
                self.requests.append(rest[:length])
                received = rest[length:]
                await stream.send_all(_answer(head.split(b" ")[1]))


def _answer(path: bytes) -> bytes:
    if path == b"/error":
        return b"HTTP/1.1 503 Busy\r\ncontent-length: 300\r\n\r\n" + ERROR_PAGE
    chunks = b"".join(b"%x\r\n%s\n\n\r\n" % (len(e) + 2, e) for e in EVENTS)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
    return head + b"\r\n\r\n" + chunks + b"0\r\n\r\n"


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    served = Server()
    async with trio.open_nursery() as nursery:
        serve = partial(trio.serve_tcp, served.handle, 0, host="127.0.0.1")
        (listener,) = await nursery.start(serve)
        served.url = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
        yield served
        nursery.cancel_scope.cancel()


async def _read(server: Server, path: str, *, reuse: bool, times: int) -> list[Stream]:
    """``times`` requests on one client, each read to ``[DONE]`` (and past it with ``reuse``)."""
    streams, events = [], list[str]()

    def on_event(data: str) -> bool:
        events.append(data)
        return False

    async with http_client(server.url, 5.0) as client:
        for _ in range(times):
            stream = Stream()
            with trio.fail_after(5):
                await read_events(client, path, {}, stream, on_event, reuse=reuse)
            streams.append(stream)
    assert events == ['{"text": "a"}', '{"text": "b"}'] * times
    return streams


async def test_reading_to_the_end_keeps_the_connection_for_the_next_request(
    server: Server,
) -> None:
    streams = await _read(server, "/generate", reuse=True, times=3)
    assert [(s.status, s.done) for s in streams] == [(200, True)] * 3
    assert server.connections == 1
    assert len(server.requests) == 3


async def test_stopping_at_done_closes_the_connection(server: Server) -> None:
    streams = await _read(server, "/generate", reuse=False, times=2)
    assert all(s.done and s.ended_at > 0 for s in streams)
    assert server.connections == 2


async def test_leaving_at_an_event_or_once_sent_closes_the_connection(server: Server) -> None:
    async with http_client(server.url, 5.0) as client:
        first = Stream()
        with trio.fail_after(5):
            await read_events(client, "/generate", {}, first, lambda data: True, reuse=True)
        assert (first.status, first.done) == (200, False)
        gone = trio.CancelScope()
        with trio.fail_after(5), gone:
            await read_events(
                client, "/generate", {}, Stream(), lambda d: False, extensions=leave_when_sent(gone)
            )
        assert gone.cancelled_caught
    assert server.connections == 2


async def test_an_error_page_keeps_its_start(server: Server) -> None:
    stream = Stream()
    async with http_client(server.url, 5.0) as client:
        with trio.fail_after(5):
            await read_events(client, "/error", {}, stream, lambda data: False)
    assert (stream.status, stream.head) == (503, "x" * 200)


def test_each_dialect_asks_for_a_stream_in_its_own_words() -> None:
    generate = request_body("/generate", "hi", 3, model="m", ignore_eos=True)
    assert generate == {
        "text": "hi",
        "stream": True,
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
    }
    completions = request_body("/v1/completions", "hi", 3, model="m")
    assert completions == {"max_tokens": 3, "stream": True, "model": "m", "prompt": "hi"}
    chat = request_body("/v1/chat/completions", "hi", 3)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert "model" not in chat
    assert "ignore_eos" not in chat
    assert json.dumps(request_body("/generate", "hi", 3)).count("ignore_eos") == 0
