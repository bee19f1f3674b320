"""The edge scenario's hostile clients, on raw sockets: non-readers, tricklers, zero-window
clients, flooders, pipeliners, resetters and fan-out clients.

What each sends and how it is timed: docs/benchmarks.md, "Hostile clients beside the
load". Each starts over on a new connection once the server let go of the last, until
the run's end; every wait is bounded, a hold or a trickle by ``hold_bound`` (reaching it
is a finding, counted), the whole by a ``trio.fail_after`` only a bug can reach.
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
from _load_config import Config, EdgeConfig
from trio_sglang.bench_endpoint._apis import request_body

__all__ = [
    "Holds",
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
    edge: EdgeConfig,
    holds: Holds,
    tally: HostileTally,
    *,
    cut_short: bool = False,
) -> None:
    """One request sent and never read, until the server lets go of it; then its answer.

    ``cut_short``: the server may let go before the request is all sent (a flooder's).
    """
    sock = await _connect(address, who, tally, receive_buffer=edge.receive_buffer)
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
        with trio.move_on_after(edge.hold_bound):
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
    index: int, address: tuple[str, int], model: str, edge: EdgeConfig, tally: HostileTally
) -> Attempt:
    body = request_body("/v1/completions", f"non-reader {index}", edge.max_tokens, model=model)
    payload = json.dumps(body | {"n": edge.samples}).encode()
    request = post_head(_authority(address), "/v1/completions", len(payload)) + payload
    return partial(_hold, address, request, "non-reader", edge, tally.nonreaders, tally)


def zero_window_preface(host: str, prompt: str, max_tokens: int, streams: int) -> bytes:
    """A zero-window client's first bytes: ``streams`` streaming ``/generate`` requests whose
    answers a server speaking HTTP/2 could then never send."""
    body = json.dumps(request_body("/generate", prompt, max_tokens)).encode()
    return h2_requests(host, streams, body, zero_window=True)


def _zero_window(
    index: int, address: tuple[str, int], model: str, edge: EdgeConfig, tally: HostileTally
) -> Attempt:
    host = _authority(address)
    prompt = f"zero-window {index}"
    request = zero_window_preface(host, prompt, edge.zero_window_tokens, edge.streams)
    return partial(_hold, address, request, "zero-window", edge, tally.zero_window, tally)


def _flooder(
    index: int, address: tuple[str, int], model: str, edge: EdgeConfig, tally: HostileTally
) -> Attempt:
    request = flood_preface()
    return partial(_hold, address, request, "flooder", edge, tally.flooders, tally, cut_short=True)


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
    index: int, address: tuple[str, int], model: str, edge: EdgeConfig, tally: HostileTally
) -> Attempt:
    """Odd ones stream and leave once answered; even ones leave a whole answer unawaited."""
    streaming = index % 2 == 1
    body = request_body("/generate", f"pipeliner {index}", edge.max_tokens)
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
    index: int, address: tuple[str, int], model: str, edge: EdgeConfig, tally: HostileTally
) -> Attempt:
    host = _authority(address)
    body = request_body("/generate", f"resetter {index}", edge.max_tokens)
    burst = h2_requests(host, edge.burst_streams, json.dumps(body | {"stream": True}).encode())
    return partial(_burst_then_reset, address, burst, tally)


def _fanout(
    index: int, address: tuple[str, int], model: str, edge: EdgeConfig, tally: HostileTally
) -> Attempt:
    body = request_body("/generate", f"fan-out {index}", edge.max_tokens)
    sampling = body.get("sampling_params", {}) | {"n": edge.fanout_children}
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
    address: tuple[str, int], head: bytes, body: bytes, edge: EdgeConfig, tally: HostileTally
) -> None:
    """One request whose body trickles in, until the server answers or closes."""
    sock = await _connect(address, "trickler", tally)
    if sock is None:
        return
    async with trio.SocketStream(sock) as stream:
        try:
            await stream.send_all(head)
        except trio.BrokenResourceError:
            tally.failures["trickler: headers not sent"] += 1
            return
        sent = trio.current_time()
        how = "no answer within the bound"
        with trio.move_on_after(edge.hold_bound):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_drip, stream, body, edge.trickle_interval)
                how = await _answer(stream)
                nursery.cancel_scope.cancel()
            tally.answers.append(trio.current_time() - sent)
        tally.trickles[how] += 1


def _trickler(
    index: int, address: tuple[str, int], model: str, edge: EdgeConfig, tally: HostileTally
) -> Attempt:
    # A body that at this pace would still be arriving at four times the server's
    # bound, so that what ends it is the bound, never the body's end.
    length = math.ceil(4 * edge.read_timeout / edge.trickle_interval)
    prompt = f"trickler {index}" + " slow" * math.ceil(length / len(" slow"))
    body = json.dumps(request_body("/v1/completions", prompt, 1, model=model)).encode()
    head = post_head(_authority(address), "/v1/completions", len(body))
    return partial(_trickle, address, head, body, edge, tally)


async def _client(
    name: str, index: int, attempt: Attempt, pace: float, config: Config, stop_at: float
) -> None:
    """One hostile client: ``attempt`` again and again, from a moment within the ramp."""
    rng = random.Random(f"{config.seed}/{name}/{index}")
    await trio.sleep(rng.uniform(0.0, config.ramp))
    await repeat(stop_at, pace, attempt)


async def run_hostile(
    url: str, model: str, edge: EdgeConfig, config: Config, tally: HostileTally
) -> None:
    """Run the hostile clients for ``config.duration`` s; return once the last let go."""
    address = _address(url)
    stop_at = trio.current_time() + config.duration
    kinds = (
        ("non-reader", edge.nonreaders, _nonreader, 0.0),
        ("trickler", edge.tricklers, _trickler, 0.0),
        ("zero-window", edge.zero_window, _zero_window, edge.pace),
        ("flooder", edge.flooders, _flooder, edge.pace),
        ("pipeliner", edge.pipeliners, _pipeliner, edge.pace),
        ("resetter", edge.resetters, _resetter, edge.pace),
        ("fan-out", edge.fanout, _fanout, edge.pace),
    )
    # The last ones start just before the end.
    deadline = config.duration + edge.hold_bound + max(_RETRY_AFTER, edge.pace) + 5.0
    with trio.fail_after(deadline):
        async with trio.open_nursery() as nursery:
            for name, count, attempt_of, pace in kinds:
                for index in range(count):
                    attempt = attempt_of(index, address, model, edge, tally)
                    nursery.start_soon(_client, name, index, attempt, pace, config, stop_at)
