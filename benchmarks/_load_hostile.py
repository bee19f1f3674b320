"""The edge scenario's hostile clients, on raw sockets: non-readers, tricklers, zero-window.

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
closed), looked at every 50 ms; and from the first bytes of its answer
(seen waiting in the receive buffer, ``FIONREAD``, not read) to the same.

A **trickler** sends its headers whole, then its body one byte every 0.5 s;
the server must answer 408 within its request-read timeout of the headers,
and close. It times that answer.

A **zero-window** client speaks HTTP/2 with prior knowledge, the way an
attack on flow control does: the connection preface, SETTINGS with
``SETTINGS_INITIAL_WINDOW_SIZE`` 0, then several short streaming
``/generate`` requests, and never a WINDOW_UPDATE, so that the server can
send no byte of any answer but its headers. It never reads either, and is
timed as a non-reader is. ``serve --http2`` resets each stream once its
answer waits for the stall timeout, and drops the connection with the last;
without ``--http2`` it reads the preface as a bad HTTP/1.1 request, answers
it, and closes at once. What it had answered is read once it let go.

Four more, each the client of an attack that once held the server (issue 37),
all paced like a zero-window client:

* a **flooder** speaks HTTP/2 and sends about 70 KB of PRIORITY frames that
  ask for nothing (999 idle streams, each then made a child of the root again
  and again); the server must drop it, and is timed as a non-reader is;
* a **pipeliner** sends a request with one byte of a next request behind it,
  reads the head of its answer (a streaming one), or waits a moment (a whole
  one), then resets: the server must stop its request and free its connection;
* a **resetter** sends a burst of streaming HTTP/2 requests in one write, then
  resets while the server is still opening their streams: every one must stop;
* a **fan-out** client asks for many completions in one request (``n``), so
  that the fan-out clients hold hundreds of engine requests, up to the
  server's bound; it reads its answer for a moment, then leaves.
These four are judged by what the server holds after them (nothing at the
engine, no connection or descriptor more than before), by the server's own
count of the flooders it dropped, and by the normal clients' latency beside them.

Each hostile client starts over on a new connection once the server let go
of the last, until the run's end (a zero-window client, which the server lets
go of at once, at most one connection every ``pace`` s: a hostile client,
not a connection flood); the last ones are seen to their end. Every wait is
bounded: a hold or a trickle by ``hold_bound`` (reaching it is a finding,
counted), the whole by a ``trio.fail_after`` only a bug can reach.
"""

from __future__ import annotations

import json
import math
import random
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal
from urllib.parse import urlsplit

import trio

from _hostile_clients import flood_preface, h2_requests, reset, unread
from _leaving_client import post_head
from trio_sglang.bench_endpoint._apis import request_body

__all__ = [
    "Holds",
    "HostileShape",
    "HostileTally",
    "LetGo",
    "repeat",
    "run_hostile",
    "zero_window_preface",
]

#: How a hold (a connection that never reads) ended: the server reset the connection,
#: closed it (a FIN: it let go of the request too), or neither within the bound.
LetGo = Literal["reset", "closed", "held past the bound"]

#: Seconds between two looks at a socket that never reads: a hold's resolution.
_LOOK_EVERY = 0.05
#: One try of a hostile client: a connection, held or trickled until the server is done.
Attempt = Callable[[], Awaitable[None]]
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
    zero_window: int
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
    #: A zero-window client's streams on each connection.
    streams: int
    #: A zero-window client starts at most one connection every ``pace`` seconds.
    pace: float
    #: The longest a hold or a trickle is waited for.
    hold_bound: float
    seed: int
    #: The clients of issue 37's attacks (see the module's docstring), each paced.
    flooders: int = 0
    pipeliners: int = 0
    resetters: int = 0
    fanout: int = 0
    #: A fan-out client's ``n``.
    fanout_children: int = 256
    #: A resetter's streaming requests in its one write.
    burst_streams: int = 50
    #: A zero-window stream's tokens: over HTTP/2 the server holds such a stream until its
    #: whole answer (or 32 KiB of it) waits, then for the stall timeout.
    zero_window_tokens: int = 8

    @property
    def deadline(self) -> float:
        """The most the hostile clients can take: the last ones start just before the end."""
        return self.duration + self.hold_bound + max(_RETRY_AFTER, self.pace) + 5.0


@dataclass(slots=True)
class Holds:
    """Connections that never read: how long the server held each, and how it let go."""

    #: Seconds from the request sent to the server letting go.
    seconds: list[float] = field(default_factory=list)
    #: Seconds from the server's first bytes (seen waiting unread) to it letting go: how
    #: long it held the connection once it had taken it and answered, without the wait
    #: to be taken and answered under load (0: both fell between two looks, or it let
    #: go without a byte).
    after_answer: list[float] = field(default_factory=list)
    let_go: Counter[LetGo] = field(default_factory=Counter)
    #: What the server had answered before it let go (read once it had), by status.
    answers: Counter[str] = field(default_factory=Counter)

    def count(self) -> int:
        return sum(self.let_go.values())


@dataclass(slots=True)
class HostileTally:
    """What the hostile clients saw."""

    nonreaders: Holds = field(default_factory=Holds)
    zero_window: Holds = field(default_factory=Holds)
    #: Seconds from each trickler's headers to the server's answer (or its close).
    answers: list[float] = field(default_factory=list)
    #: How each trickle ended: ``HTTP 408``, another status, or no answer.
    trickles: Counter[str] = field(default_factory=Counter)
    #: Connections that failed before the client could be hostile, by error.
    failures: Counter[str] = field(default_factory=Counter)
    flooders: Holds = field(default_factory=Holds)
    #: Pipeliners' requests, by what they saw before they left (``HTTP 200``, ...).
    pipelined: Counter[str] = field(default_factory=Counter)
    #: Bursts of HTTP/2 streams sent, then reset.
    bursts: int = 0
    #: Fan-out requests, by the status of their answer.
    fanout: Counter[str] = field(default_factory=Counter)


def _authority(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None, url
    assert parts.port is not None, url
    return parts.hostname, parts.port


async def _connect(
    address: tuple[str, int], who: str, tally: HostileTally, *, receive_buffer: int | None = None
) -> trio.socket.SocketType | None:
    """A connected socket; ``None`` if the connect failed (counted, then a pause: no hot loop).

    ``receive_buffer`` (``SO_RCVBUF``) is set before the connect, so that the window the
    client advertises is small from its first segment.
    """
    sock = trio.socket.socket()
    try:
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect(address)
    except OSError as exc:
        sock.close()
        tally.failures[f"{who}: {type(exc).__name__}"] += 1
        await trio.sleep(_RETRY_AFTER)
        return None
    return sock


async def repeat(stop_at: float, pace: float, attempt: Attempt) -> None:
    """``attempt()`` one after another until ``stop_at``, each start at least ``pace`` s after
    the one before (0: at once), so that an attempt the server ends at once is no hot loop."""
    while (started := trio.current_time()) < stop_at:
        await attempt()
        await trio.sleep_until(started + pace)


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


# -- connections that never read: non-readers and zero-window clients -------------


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
    address: tuple[str, int],
    request: bytes,
    who: str,
    shape: HostileShape,
    holds: Holds,
    tally: HostileTally,
    *,
    cut_short: bool = False,
) -> None:
    """One request sent and never read, until the server lets go of it; then its answer.

    ``cut_short``: the server may let go before the request is all sent (a flooder's).
    """
    sock = await _connect(address, who, tally, receive_buffer=shape.receive_buffer)
    if sock is None:
        return
    async with trio.SocketStream(sock) as stream:  # closing it unread resets: nothing lingers
        try:
            await stream.send_all(request)
        except trio.BrokenResourceError:
            if not cut_short:
                tally.failures[f"{who}: request not sent"] += 1
                return
        sent = trio.current_time()
        answered: float | None = None
        how: LetGo = "held past the bound"
        with trio.move_on_after(shape.hold_bound):
            # No event tells a socket that is not read that its peer let go: look.
            while (seen := _server_let_go(sock)) is None:
                if answered is None and unread(sock):
                    answered = trio.current_time()
                await trio.sleep(_LOOK_EVERY)
            how, now = seen, trio.current_time()
            holds.seconds.append(now - sent)
            holds.after_answer.append(0.0 if answered is None else now - answered)
            holds.answers[await _answer(stream)] += 1  # what is left of it: no wait
        holds.let_go[how] += 1


def _nonreader(
    index: int, address: tuple[str, int], model: str, shape: HostileShape, tally: HostileTally
) -> Attempt:
    body = request_body("/v1/completions", f"non-reader {index}", shape.max_tokens, model=model)
    payload = json.dumps(body | {"n": shape.samples}).encode()
    request = post_head(_authority(address), "/v1/completions", len(payload)) + payload
    return partial(_hold, address, request, "non-reader", shape, tally.nonreaders, tally)


def zero_window_preface(host: str, prompt: str, max_tokens: int, streams: int) -> bytes:
    """A zero-window client's first bytes: ``streams`` streaming ``/generate`` requests whose
    answers a server speaking HTTP/2 could then never send."""
    body = json.dumps(request_body("/generate", prompt, max_tokens)).encode()
    return h2_requests(host, streams, body, zero_window=True)


def _zero_window(
    index: int, address: tuple[str, int], model: str, shape: HostileShape, tally: HostileTally
) -> Attempt:
    host = _authority(address)
    prompt = f"zero-window {index}"
    request = zero_window_preface(host, prompt, shape.zero_window_tokens, shape.streams)
    return partial(_hold, address, request, "zero-window", shape, tally.zero_window, tally)


def _flooder(
    index: int, address: tuple[str, int], model: str, shape: HostileShape, tally: HostileTally
) -> Attempt:
    request = flood_preface()
    return partial(_hold, address, request, "flooder", shape, tally.flooders, tally, cut_short=True)


# -- clients that leave: pipeliners, resetters, fan-out -----------------------------


async def _leave_after(
    address: tuple[str, int], request: bytes, who: str, read_head: bool, stay: float,
    outcomes: Counter[str], tally: HostileTally,
) -> None:  # fmt: skip
    """Send ``request``; read its answer (or not) for ``stay`` s, then reset."""
    sock = await _connect(address, who, tally)
    if sock is None:
        return
    stream = trio.SocketStream(sock)
    try:
        await stream.send_all(request)
        with trio.move_on_after(stay + 10.0):
            outcome = await _answer(stream) if read_head else "left before the answer"
            outcomes[outcome] += 1
            with trio.move_on_after(stay):
                # A reader, until it leaves: what it is judged by is its leaving.
                while read_head and await stream.receive_some():
                    pass
                await trio.sleep_forever()
    except trio.BrokenResourceError:
        tally.failures[f"{who}: request not sent"] += 1
    finally:
        reset(sock)


def _pipeliner(
    index: int, address: tuple[str, int], model: str, shape: HostileShape, tally: HostileTally
) -> Attempt:
    """Odd ones stream and leave once answered; even ones leave a whole answer unawaited."""
    streaming = index % 2 == 1
    body = request_body("/generate", f"pipeliner {index}", shape.max_tokens)
    payload = json.dumps(body | {"stream": streaming}).encode()
    request = post_head(_authority(address), "/generate", len(payload)) + payload + b"G"
    stay = 0.5
    return partial(
        _leave_after, address, request, "pipeliner", streaming, stay, tally.pipelined, tally
    )


async def _burst_then_reset(address: tuple[str, int], burst: bytes, tally: HostileTally) -> None:
    """The whole burst in one write; a moment later, while the server opens its streams, a reset."""
    sock = await _connect(address, "resetter", tally)
    if sock is None:
        return
    try:
        await trio.SocketStream(sock).send_all(burst)
        tally.bursts += 1
        await trio.sleep(0.02)
    except trio.BrokenResourceError:
        tally.failures["resetter: burst not sent"] += 1
    finally:
        reset(sock)


def _resetter(
    index: int, address: tuple[str, int], model: str, shape: HostileShape, tally: HostileTally
) -> Attempt:
    host = _authority(address)
    body = request_body("/generate", f"resetter {index}", shape.max_tokens)
    burst = h2_requests(host, shape.burst_streams, json.dumps(body | {"stream": True}).encode())
    return partial(_burst_then_reset, address, burst, tally)


def _fanout(
    index: int, address: tuple[str, int], model: str, shape: HostileShape, tally: HostileTally
) -> Attempt:
    body = request_body("/generate", f"fan-out {index}", shape.max_tokens)
    sampling = body.get("sampling_params", {}) | {"n": shape.fanout_children}
    payload = json.dumps(body | {"stream": True, "sampling_params": sampling}).encode()
    request = post_head(_authority(address), "/generate", len(payload)) + payload
    return partial(_leave_after, address, request, "fan-out", True, 1.0, tally.fanout, tally)


# -- tricklers ---------------------------------------------------------------------


async def _drip(stream: trio.SocketStream, body: bytes, interval: float) -> None:
    """The body a byte at a time; quietly stops once the server has closed."""
    try:
        for at in range(len(body)):
            await trio.sleep(interval)
            await stream.send_all(body[at : at + 1])
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


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


def _trickler(
    index: int, address: tuple[str, int], model: str, shape: HostileShape, tally: HostileTally
) -> Attempt:
    # A body that at this pace would still be arriving at four times the server's
    # bound, so that what ends it is the bound, never the body's end.
    length = math.ceil(4 * shape.read_timeout / shape.trickle_interval)
    prompt = f"trickler {index}" + " slow" * math.ceil(length / len(" slow"))
    body = json.dumps(request_body("/v1/completions", prompt, 1, model=model)).encode()
    head = post_head(_authority(address), "/v1/completions", len(body))
    return partial(_trickle, address, head, body, shape, tally)


async def _client(
    name: str, index: int, attempt: Attempt, pace: float, shape: HostileShape, stop_at: float
) -> None:
    """One hostile client: ``attempt`` again and again, from a moment within the ramp."""
    rng = random.Random(f"{shape.seed}/{name}/{index}")
    await trio.sleep(rng.uniform(0.0, shape.ramp))
    await repeat(stop_at, pace, attempt)


async def run_hostile(url: str, model: str, shape: HostileShape, tally: HostileTally) -> None:
    """Run the hostile clients for ``shape.duration`` s; return once the last let go."""
    address = _address(url)
    stop_at = trio.current_time() + shape.duration
    kinds = (
        ("non-reader", shape.nonreaders, _nonreader, 0.0),
        ("trickler", shape.tricklers, _trickler, 0.0),
        ("zero-window", shape.zero_window, _zero_window, shape.pace),
        ("flooder", shape.flooders, _flooder, shape.pace),
        ("pipeliner", shape.pipeliners, _pipeliner, shape.pace),
        ("resetter", shape.resetters, _resetter, shape.pace),
        ("fan-out", shape.fanout, _fanout, shape.pace),
    )
    with trio.fail_after(shape.deadline):
        async with trio.open_nursery() as nursery:
            for name, count, attempt_of, pace in kinds:
                for index in range(count):
                    attempt = attempt_of(index, address, model, shape, tally)
                    nursery.start_soon(_client, name, index, attempt, pace, shape, stop_at)
