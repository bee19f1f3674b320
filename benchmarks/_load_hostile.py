"""The edge scenario's hostile clients, on raw sockets: non-readers and tricklers.

A **non-reader** sets a small receive buffer (``SO_RCVBUF``, before connecting,
so that the window it advertises is small from its first segment), sends one
streaming request and never reads a byte of the answer, its socket kept
open, until the server lets go. Its request asks for several samples of a
long answer (``/v1/completions`` with ``n``): the load's own request, 16
tokens of about 200 bytes, fits whole in the kernel's buffers (the client's
receive window, and the 16 KiB a trio socket holds unsent before a write
waits, ``TCP_NOTSENT_LOWAT``), so the server's write would never block and
the request would end as a normal one, unnoticed. Four samples, at a token
each every 250 ms, fill those buffers in about 6 s; then the server's write
blocks and its stall timeout runs.

How long the server held a non-reader's request is timed from the request
sent to the server letting go, as the client can see it without reading:
the error a recv or send would raise (``SO_ERROR``: the server's reset),
or, on Linux, the connection no longer established (``TCP_INFO``: reset, or
closed), looked at every 50 ms.

A **trickler** sends its headers whole, then its body one byte every 0.5 s;
the server must answer 408 within its request-read timeout of the headers,
and close. It times that answer.

Each hostile client starts over on a new connection once the server let go
of the last, until the run's end; the last ones are seen to their end.
Every wait is bounded: a hold or a trickle by ``hold_bound`` (reaching it is
a finding, counted), the whole by a ``trio.fail_after`` only a bug can reach.
"""

from __future__ import annotations

import json
import math
import random
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import trio

from _load_clients import request_body

__all__ = ["HostileShape", "HostileTally", "LetGo", "run_hostile"]

#: How a non-reader's hold ended: the server reset the connection, closed it
#: (a FIN: it let go of the request too), or neither within the bound.
LetGo = Literal["reset", "closed", "held past the bound"]

#: Seconds between two looks at a non-reader's socket: a hold's resolution.
_LOOK_EVERY = 0.05
#: Seconds before a client whose connect failed tries again (no hot loop).
_RETRY_AFTER = 0.5
#: Linux's TCP states (``include/net/tcp_states.h``) that ``TCP_INFO`` starts with.
_ESTABLISHED, _CLOSE = 1, 7
_TCP_INFO: int | None = getattr(socket, "TCP_INFO", None)


@dataclass(frozen=True, slots=True)
class HostileShape:
    """What the hostile clients do; times in seconds."""

    nonreaders: int
    tricklers: int
    #: No hostile client starts over after this; they start within ``ramp``.
    duration: float
    ramp: float
    #: A non-reader's request: ``n`` samples of ``max_tokens`` tokens each.
    samples: int
    max_tokens: int
    #: A non-reader's ``SO_RCVBUF`` in bytes (the kernel doubles it).
    receive_buffer: int
    #: A trickler's pace: one byte of its body each ``trickle_interval``.
    trickle_interval: float
    #: The server's request-read timeout, which sizes a trickler's body to outlast it.
    read_timeout: float
    #: The longest a hold or a trickle is waited for.
    hold_bound: float
    seed: int

    @property
    def deadline(self) -> float:
        """The most the hostile clients can take: the last ones start just before the end."""
        return self.duration + self.hold_bound + _RETRY_AFTER + 5.0


@dataclass(slots=True)
class HostileTally:
    """What the hostile clients saw."""

    #: Seconds each non-reader's request was held: sent, to the server letting go.
    holds: list[float] = field(default_factory=list)
    let_go: Counter[LetGo] = field(default_factory=Counter)
    #: Seconds from each trickler's headers to the server's answer (or its close).
    answers: list[float] = field(default_factory=list)
    #: How each trickle ended: ``HTTP 408``, another status, or no answer.
    trickles: Counter[str] = field(default_factory=Counter)
    #: Connections that failed before the client could be hostile, by error.
    failures: Counter[str] = field(default_factory=Counter)


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None, url
    assert parts.port is not None, url
    return parts.hostname, parts.port


def _post(address: tuple[str, int], path: str, body: bytes) -> bytes:
    """A request's head: HTTP/1.1, with the body's length."""
    host, port = address
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()


# -- non-readers -------------------------------------------------------------------


def _server_let_go(sock: trio.socket.SocketType) -> LetGo | None:
    """How the server let go of the connection, if it did; read without taking a byte."""
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
        return "reset"  # the error a recv or send would raise now
    if _TCP_INFO is None:
        return None
    state = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 1)[0]
    if state == _ESTABLISHED:
        return None
    return "reset" if state == _CLOSE else "closed"


async def _hold(
    address: tuple[str, int], request: bytes, shape: HostileShape, tally: HostileTally
) -> None:
    """One request sent and never read, until the server lets go of it."""
    sock = trio.socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, shape.receive_buffer)
        await sock.connect(address)
    except OSError as exc:
        sock.close()
        tally.failures[f"non-reader: {type(exc).__name__}"] += 1
        await trio.sleep(_RETRY_AFTER)
        return
    async with trio.SocketStream(sock) as stream:  # closing it unread resets: nothing lingers
        try:
            await stream.send_all(request)
        except trio.BrokenResourceError:
            tally.failures["non-reader: request not sent"] += 1
            return
        sent = trio.current_time()
        how: LetGo = "held past the bound"
        with trio.move_on_after(shape.hold_bound):
            # No event tells a socket that is not read that its peer let go: look.
            while (seen := _server_let_go(sock)) is None:  # noqa: ASYNC110
                await trio.sleep(_LOOK_EVERY)
            how = seen
            tally.holds.append(trio.current_time() - sent)
        tally.let_go[how] += 1


async def _nonreader(
    index: int,
    address: tuple[str, int],
    model: str,
    shape: HostileShape,
    stop_at: float,
    tally: HostileTally,
) -> None:
    rng = random.Random(f"{shape.seed}/non-reader/{index}")
    body = request_body("/v1/completions", model, f"non-reader {index}", shape.max_tokens)
    payload = json.dumps(body | {"n": shape.samples}).encode()
    request = _post(address, "/v1/completions", payload) + payload
    await trio.sleep(rng.uniform(0.0, shape.ramp))
    while trio.current_time() < stop_at:
        await _hold(address, request, shape, tally)


# -- tricklers ---------------------------------------------------------------------


async def _drip(stream: trio.SocketStream, body: bytes, interval: float) -> None:
    """The body a byte at a time; quietly stops once the server has closed."""
    try:
        for at in range(len(body)):
            await trio.sleep(interval)
            await stream.send_all(body[at : at + 1])
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def _answer(stream: trio.SocketStream) -> str:
    """The status of the server's answer, or how the connection ended without one."""
    received = b""
    try:
        while b"\r\n" not in received:
            chunk = await stream.receive_some()
            if not chunk:
                return "closed without an answer"
            received += chunk
    except trio.BrokenResourceError:
        return "reset without an answer"
    status_line = received.split(b"\r\n", 1)[0].decode(errors="replace")
    return f"HTTP {status_line.partition(' ')[2].partition(' ')[0]}"


async def _trickle(
    address: tuple[str, int], head: bytes, body: bytes, shape: HostileShape, tally: HostileTally
) -> None:
    """One request whose body trickles in, until the server answers or closes."""
    try:
        stream = await trio.open_tcp_stream(*address)
    except OSError as exc:
        tally.failures[f"trickler: {type(exc).__name__}"] += 1
        await trio.sleep(_RETRY_AFTER)
        return
    async with stream:
        try:
            await stream.send_all(head)
        except trio.BrokenResourceError:
            tally.failures["trickler: headers not sent"] += 1
            return
        sent = trio.current_time()
        how = "no answer within the bound"
        with trio.move_on_after(shape.hold_bound):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_drip, stream, body, shape.trickle_interval)
                how = await _answer(stream)
                nursery.cancel_scope.cancel()
            tally.answers.append(trio.current_time() - sent)
        tally.trickles[how] += 1


async def _trickler(
    index: int,
    address: tuple[str, int],
    model: str,
    shape: HostileShape,
    stop_at: float,
    tally: HostileTally,
) -> None:
    rng = random.Random(f"{shape.seed}/trickler/{index}")
    # A body that at this pace would still be arriving at four times the server's
    # bound, so that what ends it is the bound, never the body's end.
    length = math.ceil(4 * shape.read_timeout / shape.trickle_interval)
    prompt = f"trickler {index}" + " slow" * math.ceil(length / len(" slow"))
    body = json.dumps(request_body("/v1/completions", model, prompt, 1)).encode()
    head = _post(address, "/v1/completions", body)
    await trio.sleep(rng.uniform(0.0, shape.ramp))
    while trio.current_time() < stop_at:
        await _trickle(address, head, body, shape, tally)


async def run_hostile(url: str, model: str, shape: HostileShape, tally: HostileTally) -> None:
    """Run the hostile clients for ``shape.duration`` s; return once the last let go."""
    address = _address(url)
    stop_at = trio.current_time() + shape.duration
    with trio.fail_after(shape.deadline):
        async with trio.open_nursery() as nursery:
            for index in range(shape.nonreaders):
                nursery.start_soon(_nonreader, index, address, model, shape, stop_at, tally)
            for index in range(shape.tricklers):
                nursery.start_soon(_trickler, index, address, model, shape, stop_at, tally)
