"""``HostedRoutes``: the hosted application's routes (SGLang's server), behind ``serve``'s edge.

The hosted application builds every request and every response
(``_hosted_app.py``); what reaches it has passed ``serve``'s edge (the
connection's bounds, authentication, the body's size and read time), and
what it does is bounded by it:

- its body is read here, within the limits, and handed over whole;
- its engine requests run through the lifecycle (``HTTPExchange``);
- a client that leaves, at any moment, stops them at once: the request's
  task group is cancelled, the hosted route with it, and the application
  sees ``http.disconnect``;
- a streaming response that is silent for ``--sse-heartbeat`` sends blank
  lines (``Heartbeats``), as ``serve``'s own routes do, so that a proxy that
  notices a gone client only when it writes notices within that;
- every write is bounded by the connection (``--client-stall-timeout``):
  a client that takes nothing is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from .._core._worker import Worker
from .._hosted_app import EXCHANGE_KEY, SEND_NOW_KEY, HostedApp
from .._limits import ServerLimits
from ._admission import Admission
from ._asgi import (
    SSE_HEARTBEAT,
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    read_body_within,
    send_json,
)
from ._connection import current_connection
from ._http_errors import HTTPError
from ._http_exchange import HTTPExchange
from ._inflight import InFlight
from ._metrics import Outcome, ServerMetrics
from ._outbox import Heartbeats

__all__ = ["HostedRoutes"]

logger = logging.getLogger("trio_sglang.server")


class HostedRoutes:
    """Every route the hosted application serves; see the module."""

    def __init__(
        self,
        app: HostedApp,
        *,
        worker: Worker,
        admission: Admission,
        inflight: InFlight,
        metrics: ServerMetrics,
        heartbeats: Heartbeats,
        limits: ServerLimits,
        closing: Callable[[], bool],
    ) -> None:
        self._app = app
        self._worker = worker
        self._admission = admission
        self._inflight = inflight
        self._metrics = metrics
        self._heartbeats = heartbeats
        self._limits = limits
        self._closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limits = self._limits
        try:
            body = await read_body_within(
                scope, receive, limits.max_body_bytes, limits.request_read_timeout
            )
        except ClientGone:
            return
        except HTTPError as exc:
            await send_json(send, exc.status, exc.body(), exc.headers)
            return
        gone = trio.Event()
        handed = False

        async def app_receive() -> Message:
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        exchange: HTTPExchange | None = None
        try:
            async with trio.open_nursery() as nursery:
                exchange = HTTPExchange(
                    nursery, scope, self._worker, self._admission, self._inflight, self._closing
                )
                response = _Response(send, nursery, self._heartbeats, limits, exchange)
                nursery.start_soon(self._watch_disconnect, receive, exchange, response, gone)
                try:
                    seam = {EXCHANGE_KEY: exchange, SEND_NOW_KEY: response.send_now}
                    await self._app({**scope, **seam}, app_receive, response.send)
                except Exception:
                    logger.exception("%s %s failed", scope["method"], scope["path"])
                    if not response.started:
                        error = HTTPError(500, "internal server error", kind="server_error")
                        await send_json(send, 500, error.body())
                finally:
                    response.ended = True
                nursery.cancel_scope.cancel()  # what still runs once the route has answered
            self._count(scope["path"], exchange, response)
        finally:
            if exchange is not None:  # however it ends: nothing stays in flight
                exchange.close()

    @staticmethod
    async def _watch_disconnect(
        receive: Receive, exchange: HTTPExchange, response: _Response, gone: trio.Event
    ) -> None:
        """The client left: its requests stop, the route is cancelled, the app hears of it."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if response.ended:  # it went after its whole answer: nothing to stop
            return
        exchange.leave()
        gone.set()
        exchange.cancel()

    def _count(self, endpoint: str, exchange: HTTPExchange, response: _Response) -> None:
        """Requests that reached the engine, by route and outcome (the path of one is a route)."""
        if not exchange.feeds:
            return
        ends = {feed.end for feed in exchange.feeds}
        outcome: Outcome
        if exchange.left:
            outcome = "cancelled"
            delivered = any(feed.delivered for feed in exchange.feeds)
            phase = "mid_stream" if delivered else "before_first_token"
            self._metrics.cancellations.labels(phase).inc()
        elif "aborted" in ends:
            outcome = "aborted"
        elif "failed" in ends:
            outcome = "failed"
        elif "shutdown" in ends:
            outcome = "shutdown"
        elif response.status >= 400:
            outcome = "rejected"
        else:
            outcome = "completed"
        self._metrics.requests.labels(endpoint, outcome).inc()


class _Response:
    """The hosted route's response as it goes out: bounded writes, heartbeats while silent."""

    def __init__(
        self,
        send: Send,
        nursery: trio.Nursery,
        heartbeats: Heartbeats,
        limits: ServerLimits,
        exchange: HTTPExchange,
    ) -> None:
        self._send = send
        self._nursery = nursery
        self._heartbeats = heartbeats
        self._limits = limits
        self._exchange = exchange
        self._lock = trio.Lock()
        self._beat_due = trio.Event()
        self.started = False
        self.status = 0
        self.ended = False
        self.last_active = trio.current_time()
        self._beat_asked = self.last_active
        #: The connection's write that does not wait, once a streamed body is under way.
        self._write_at_once: Callable[[bytes], bool] | None = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.status = int(message["status"])
            if _is_event_stream(message):
                self._nursery.start_soon(self._beat_while_silent)
                connection = current_connection()
                if connection is not None:
                    self._write_at_once = connection.send_body_now
        elif not message.get("more_body", False):
            self.ended = True
        async with self._lock:
            await self._write(message)

    def send_now(self, message: Message) -> bool:
        """A chunk of a streamed body, written at once where it can be (``SendNow``).

        Under ``serve``, over HTTP/1.1, with no write of this response in
        progress; the connection's bounds still hold, because what the socket
        does not take at once goes the usual way (``send_body_now``).
        """
        write = self._write_at_once
        if (
            write is None
            or self.ended
            or self._lock.locked()
            or message["type"] != "http.response.body"
            or not message.get("more_body", False)
            or not write(bytes(message.get("body", b"")))
        ):
            return False
        self.last_active = trio.current_time()
        return True

    def beat(self) -> None:
        self._beat_asked = trio.current_time()
        self._beat_due.set()

    async def _beat_while_silent(self) -> None:
        with self._heartbeats.watching(self):
            while True:
                await self._beat_due.wait()
                self._beat_due = trio.Event()
                async with self._lock:
                    if self.ended:
                        return
                    if self.last_active >= self._beat_asked:  # the route spoke meanwhile
                        continue
                    heartbeat = {"type": "http.response.body", "body": SSE_HEARTBEAT}
                    await self._write({**heartbeat, "more_body": True})

    async def _write(self, message: Message) -> None:
        # Under ``serve`` the connection bounds every write (``BoundedH2`` over
        # HTTP/2); under any other ASGI server the bound is here.
        if current_connection() is not None:
            await self._send(message)
        else:
            with trio.move_on_after(self._limits.client_stall_timeout) as bound:
                await self._send(message)
            if bound.cancelled_caught:
                self._exchange.leave()
                self._nursery.cancel_scope.cancel()
                return
        self.last_active = trio.current_time()


def _is_event_stream(start: Message) -> bool:
    for name, value in start.get("headers", ()):
        if bytes(name).lower() == b"content-type":
            return bytes(value).lower().startswith(b"text/event-stream")
    return False
