"""``ClientConnection``: one client's connection, which it can never hold open against us.

hypercorn's trio connection (``TCPServer``) with six differences, all but
the fifth each found by a client that held the server, the fifth by the
serving benchmark (``benchmarks/serve_throughput.py``):

* **A write that the client does not take is bounded.** hypercorn shields
  each socket write, so that neither the app nor its own shutdown can
  interrupt one: a client that stops reading would hold its connection, its
  request and the shutdown forever. Here the write has a deadline inside the
  shield (``client_stall_timeout``); past it the client is dropped.
* **A client that has gone is let go at once.** After the client's EOF,
  hypercorn still waits out its keep-alive timer before the connection ends.
* **The connection can be dropped from outside** (``drop``): the socket is
  reset, which also ends a write in progress. The app drops a client that has
  fallen too far behind, and the server drops an idle connection when it has
  no room for a new one, and whatever its shutdown grace did not see close.
* **HTTP/2 only if asked for** (``http2``): otherwise the connection stays
  HTTP/1.1 (``HTTP11`` without upgrades): an h2c upgrade is answered in HTTP/1.1, and
  the HTTP/2 preface is taken as the HTTP/1.1 request it reads as (and gets
  a 404, then a 400 for what follows it). Asked for, it is hypercorn's
  HTTP/2 with the same deadline on each wait for a client's flow-control
  window (``BoundedH2``): a stream its client takes nothing of is reset,
  and a connection left with none is dropped.
* **A write the socket can take goes out at once** (``_write_now``), without
  the lock wait, the shield and the deadline a write that has to wait needs.
  A streamed response is a write per event, and those cost more than the
  write itself. An application on another loop in this thread (SGLang's,
  hosted) can write a chunk of its response that way itself
  (``send_body_now``), without handing it to a trio task first.
* **Nothing of HTTP before the first byte** (``_first_byte``): until the
  client sends something, its connection is a socket and one parked task.
  hypercorn's protocol, task group and keep-alive timer (about 13 KiB a
  connection) come with the first byte, so thousands of clients that connect
  and send nothing hold a third of the memory, and are shed three times as
  fast when the server needs their slots.
* **The socket is read while a response is in progress** (``HTTP11``): a
  client that sent bytes of a next request behind its first one can still be
  seen to leave, and one that sends more than ``PIPELINE_BYTES`` ahead is
  dropped.

The app finds the connection it is serving with ``current_connection()``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import struct
from collections import Counter
from contextvars import ContextVar
from functools import partial
from typing import Literal

import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState

from ._h2 import ClientBounds, Protocols
from ._h11 import HTTP11, ClientLeft, PipelinedTooFar
from ._metrics import ServerMetrics

__all__ = ["ClientConnection", "DropLog", "DropReason", "current_connection"]

logger = logging.getLogger("trio_sglang.server")

#: Why a client was dropped: ``stalled`` (took no bytes for the stall timeout),
#: ``behind`` (further behind its stream than the server holds), ``idle``
#: (between requests, or before its first, when the server had no room for a
#: new connection), ``shutdown`` (still connected when the shutdown grace ended),
#: ``pipelined`` (sent more than ``PIPELINE_BYTES`` of a next request before its
#: response ended), ``flooding`` (sent HTTP/2 control frames past its budget).
DropReason = Literal["stalled", "behind", "idle", "shutdown", "pipelined", "flooding"]

_current: ContextVar[ClientConnection] = ContextVar("trio_sglang_connection")

#: SO_LINGER on, 0 s: close() resets the connection and frees it at once,
#: instead of keeping unsent bytes queued for a client that takes none.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)
#: A write is bounded per this many bytes taken by the client.
_PIECE_BYTES = 1 << 16


def current_connection() -> ClientConnection | None:
    """The connection the calling request arrived on (``None`` outside ``serve``)."""
    return _current.get(None)


class ClientConnection(TCPServer):
    """Serve one accepted connection until the client or the server ends it."""

    def __init__(
        self,
        app: AppWrapper,
        config: Config,
        context: WorkerContext,
        stream: trio.SocketStream,
        *,
        stall_timeout: float,
        metrics: ServerMetrics,
        http2: bool = False,
        drops: DropLog | None = None,
    ) -> None:
        # hypercorn annotates the stream as an SSLStream; its own loop passes
        # plain SocketStreams, as here.
        super().__init__(app, config, context, ConnectionState({}), stream)  # type: ignore[arg-type]
        self._socket = stream.socket
        self._stall_timeout = stall_timeout
        self._metrics = metrics
        self._http2 = http2
        self._drops = DropLog() if drops is None else drops
        self.dropped: DropReason | None = None
        #: No request in flight: before the first one's headers, or between two.
        self.idle = True
        #: The wait for the first byte, while it lasts (``stop_waiting`` ends it).
        self._waiting: trio.CancelScope | None = None
        #: When the first request's headers are due: a keep-alive timeout after the connect.
        self._first_deadline: float | None = None
        #: The rest of a piece ``send_body_now`` wrote in part: the next write's first bytes.
        self._unsent = b""

    async def serve(self) -> None:
        """Run the connection; the app's tasks for it see it as ``current_connection()``."""
        _current.set(self)  # this task's context: the app's tasks start from a copy of it
        if await self._first_byte():
            await self.run()

    def stop_waiting(self) -> None:
        """End the wait for a first byte (at shutdown: a client that sent nothing is let go)."""
        if self._waiting is not None:
            self._waiting.cancel()

    async def _first_byte(self) -> bool:
        """Whether the client sent a byte within the keep-alive timeout: then HTTP starts.

        A client that sent nothing in time, closed, reset, or was dropped, is
        let go here without hypercorn ever being set up for it (the caller
        closes the socket). The byte is only peeked at: hypercorn reads it.
        """
        self._first_deadline = trio.current_time() + self.config.keep_alive_timeout
        with trio.CancelScope(deadline=self._first_deadline) as self._waiting:
            try:
                await trio.lowlevel.wait_readable(self._socket)
                return await self._socket.recv(1, socket.MSG_PEEK) != b""
            except (OSError, trio.ClosedResourceError):  # reset, or dropped while waiting
                return False
            finally:
                self._waiting = None
        return False

    async def _idle_timeout(self) -> None:
        # hypercorn's, but the first request's headers are due a keep-alive
        # timeout after the connect, not after its first byte: the wait in
        # ``_first_byte`` gives a slow client no second timeout.
        deadline, self._first_deadline = self._first_deadline, None
        if deadline is None:
            await super()._idle_timeout()
            return
        with trio.move_on_at(deadline):
            await self.context.terminated.wait()
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()

    @property
    def http1(self) -> bool:
        """Whether it speaks HTTP/1.1 (not upgraded to HTTP/2): every write is then ours."""
        return isinstance(self.protocol.protocol, H11Protocol)

    def drop(self, reason: DropReason) -> None:
        """Reset the connection now (idempotent); counted and logged once.

        A write in progress ends with the socket, and the app sees the client
        disconnect, which stops its request at the engine.
        """
        if self.dropped is not None:
            return
        self.dropped = reason
        self._count(reason)
        with contextlib.suppress(OSError):  # already closed, or the peer's reset came first
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        self._socket.close()

    def _count(self, reason: DropReason) -> None:
        self._metrics.clients_dropped.labels(reason).inc()
        # Each at DEBUG; those that were gone (stalled, behind) also at INFO, but
        # in one line per interval with a count: a thousand slow readers at once
        # are a line, not a thousand. Idle ones and those of a shutdown (counted
        # once, there) only at DEBUG.
        logger.debug("dropped client %s: %s", _peer(self._socket), _WHY[reason])
        if reason in ("stalled", "behind", "pipelined", "flooding"):
            self._drops.note(reason)

    def _stream_stalled(self, last: bool) -> None:
        """An HTTP/2 stream was reset, its client having taken none of it in time.

        Counted as a stalled client; ``last``: the connection has no other
        stream open, and is dropped.
        """
        if last:
            self.drop("stalled")
        else:
            self._count("stalled")

    async def protocol_send(self, event: Event) -> None:
        if not isinstance(event, RawData):
            if isinstance(event, Updated):
                self.idle = event.idle
            await super().protocol_send(event)
            return
        # The lock orders writes as hypercorn's does; free, it is taken without a wait.
        try:
            self.send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self.send_lock.acquire()
        try:
            data = event.data
            if self._unsent:
                data, self._unsent = self._unsent + data, b""
            written = self._write_now(data)
            sent = written is not None
            if written is not None and written < len(data):
                # Shielded as hypercorn's own write is: a write cut short by the
                # app's cancellation would corrupt the HTTP stream.
                with trio.CancelScope(shield=True):
                    sent = await self._send_bounded(memoryview(data)[written:])
            if not sent:
                await self.protocol.handle(Closed())
        finally:
            self.send_lock.release()

    def send_body_now(self, body: bytes) -> bool:
        """Write ``body`` as the next piece of the HTTP/1.1 response in progress, without waiting.

        For an application on another event loop in this thread (SGLang's,
        hosted), whose every chunk would otherwise be handed to a trio task
        to be written. ``False``, with nothing sent, where it cannot go out
        that way: another write is in progress, the connection is not
        HTTP/1.1 or has no body of that kind in progress (``HTTP11.frame_body``),
        or the socket takes none of it now (full, or the client gone); the
        caller then sends it the usual way, where a wait is bounded and a
        gone client is seen. What the socket takes only in part is written
        first by the next write, which the response's end always is.
        """
        protocol = self.protocol.protocol
        if self._unsent or self.send_lock.locked() or not isinstance(protocol, HTTP11):
            return False
        data = protocol.frame_body(body)
        if data is None:
            return False
        written = self._write_now(data)
        if not written:
            return False
        self._unsent = data[written:]
        return True

    def _write_now(self, data: bytes) -> int | None:
        """How much of ``data`` the socket takes at once (None: the connection is gone).

        A streamed event nearly always fits in the socket's send buffer, so it
        goes out here: one ``write``, with no cancel scope, no deadline and no
        trip through the scheduler, each of which costs more than the write
        itself. Only what the socket did not take waits, bounded, in
        ``_send_bounded``. The descriptor is trio's, non-blocking (POSIX, as
        the CLI); a socket already closed (a drop, hypercorn's close) has the
        descriptor -1, so a closed connection is never written to by number.
        """
        try:
            return os.write(self._socket.fileno(), data)
        except BlockingIOError:
            return 0
        except OSError:  # reset, broken pipe, or closed: the client is gone
            return None

    async def _send_bounded(self, data: memoryview) -> bool:
        """Whether all of ``data`` went out; a client that takes none of a piece in time is dropped.

        The deadline fires inside the caller's shield. It is per piece, so a
        slow client that keeps taking bytes is never dropped for the size of
        a response.
        """
        try:
            for start in range(0, len(data), _PIECE_BYTES):
                with trio.move_on_after(self._stall_timeout) as bound:
                    await self.stream.send_all(data[start : start + _PIECE_BYTES])
                if bound.cancelled_caught:
                    self.drop("stalled")
                    return False
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            # Busy: hypercorn is closing the stream beside this write, the
            # client having gone between two writes of one answer.
            return False
        return True

    async def _read_data(self) -> None:
        # Called once, after hypercorn made the protocol and before any byte is read.
        http11 = self.protocol.protocol
        if isinstance(http11, H11Protocol):
            ours = HTTP11.instead_of(http11, sock=self._socket, upgrades=self._http2)
            if self._http2:
                bounds = ClientBounds(
                    self._stall_timeout, self._stream_stalled, partial(self.drop, "flooding")
                )
                self.protocol = Protocols.instead_of(self.protocol, bounds)
            self.protocol.protocol = ours
        try:
            await super()._read_data()
        except ClientLeft:  # while its response was in progress, with bytes of a next one sent
            await self.protocol.handle(Closed())
        except PipelinedTooFar:
            self.drop("pipelined")
            await self.protocol.handle(Closed())
        # The client is gone (EOF, reset, or dropped): end its keep-alive wait
        # too, which hypercorn would otherwise sit out before closing.
        await self.idle_task.stop()


class DropLog:
    """The INFO line for dropped clients: at most one per ``interval`` seconds.

    The first drop is logged at once; those within the next ``interval`` are
    counted, and the next line after it says how many there were.
    ``trio_sglang_clients_dropped_total`` counts each.
    """

    def __init__(self, interval: float = 10.0) -> None:
        self._interval = interval
        self._next = -math.inf
        self._pending: Counter[DropReason] = Counter()

    def note(self, reason: DropReason) -> None:
        self._pending[reason] += 1
        now = trio.current_time()
        if now < self._next:
            return
        self._next = now + self._interval
        counts = ", ".join(f"{n} {why}" for why, n in sorted(self._pending.items()))
        logger.info(
            "dropped clients (%s): gone without closing, or past a bound of the server's "
            "(the reasons: trio_sglang_clients_dropped_total's help); those of the next %g s "
            "are counted there, and summed in the next such line",
            counts,
            self._interval,
        )
        self._pending.clear()


_WHY: dict[DropReason, str] = {
    "stalled": "it took no bytes of its response within the stall timeout",
    "behind": "it fell further behind its stream than the server holds",
    "idle": "it was idle when the server had no room for a new connection",
    "shutdown": "still connected when the shutdown grace ended",
    "pipelined": "it sent more of a next request than the server holds before its response ended",
    "flooding": "it sent more HTTP/2 control frames than its budget",
}


def _peer(sock: trio.socket.SocketType) -> str:
    try:
        host, port, *_ = sock.getpeername()
    except OSError:
        return "(gone)"
    return f"{host}:{port}"
