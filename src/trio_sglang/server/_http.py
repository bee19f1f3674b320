"""The HTTP side of ``serve``: accept connections, each isolated and bounded, until shutdown.

The shape is hypercorn's own trio worker (listen, accept into a handler
nursery, give the handlers a grace deadline at shutdown), with what it lacks
for a server that must stay up and always stop:

* at most ``max_connections`` connections at once: past it the server stops
  accepting, so connections wait in the kernel's queue instead of taking
  the process's file descriptors;
* a connection that fails inside hypercorn (its HTTP/2 code raises on some
  clients' probes) ends that connection only, logged in one line;
* whatever connections the shutdown grace did not see close are reset, so
  that shutdown finishes whatever the clients do.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import cast

import trio
from hypercorn.config import Config
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ASGIFramework
from hypercorn.utils import repr_socket_addr, wrap_app

from .._core._drain import Drain
from .._core._throttle import LogThrottle
from .._limits import ServerLimits
from ._app import ServerApp
from ._connection import ClientConnection, DropLog

__all__ = ["HTTPServer", "ListenError"]

logger = logging.getLogger("trio_sglang.server")

#: accept() errors that mean "out of descriptors or memory for now": wait and retry.
_RESOURCE_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_ACCEPT_RETRY_DELAY = 0.1


class ListenError(OSError):
    """The server could not listen where it was told (a port in use, an address not here)."""


class HTTPServer:
    """Serves ``app`` on ``config.bind`` within ``limits``; see ``run``."""

    def __init__(self, app: ServerApp, config: Config, limits: ServerLimits) -> None:
        self._app = app
        self._wrapped: AppWrapper = wrap_app(
            cast("ASGIFramework", app), config.wsgi_max_body_size, "asgi"
        )
        self._config = config
        self._limits = limits
        self._context = WorkerContext(None)
        self._slots = trio.Semaphore(limits.max_connections)
        self._connections: Drain[ClientConnection] = Drain()
        self._starved = False  # accept() is out of descriptors: logged once per episode
        self._drops = DropLog()  # one INFO line per interval for clients that were gone
        self._faults = LogThrottle()  # a client can trip hypercorn at will: a few lines

    def hurry(self) -> None:
        """End the shutdown grace now (a second signal): open connections are reset."""
        self._connections.hurry()

    async def run(
        self,
        shutdown: trio.Event,
        *,
        task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until ``shutdown`` is set, then close every connection within the grace.

        Reports the URLs once listening. At shutdown the app ends its
        responses, idle keep-alive connections close, the others get
        ``config.graceful_timeout`` to finish, and what is left is reset.
        """
        try:
            sockets = self._config.create_sockets()  # binds
        except OSError as exc:
            where = ", ".join(self._config.bind)
            raise ListenError(f"cannot listen on {where}: {exc.strerror or exc}") from exc
        listeners = []
        urls = []
        for sock in sockets.insecure_sockets:
            sock.listen(self._config.backlog)
            listeners.append((trio.SocketListener(trio.socket.from_stdlib_socket(sock)), sock))
            urls.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
        async with trio.open_nursery() as handlers:
            async with trio.open_nursery() as accepting:
                accepting.start_soon(self._app.heartbeats.run)
                for listener, sock in listeners:
                    accepting.start_soon(self._accept, listener, sock, handlers)
                task_status.started(urls)
                await shutdown.wait()
                self._app.close()  # end the responses; their cleanup is the worker's
                accepting.cancel_scope.cancel()
            await self._context.terminated.set()  # idle keep-alive connections close
            for connection in self._connections:  # and those that never sent a byte
                connection.stop_waiting()
            grace = trio.current_time() + self._config.graceful_timeout
            if not await self._connections.wait(grace):
                logger.warning(
                    "reset %d connections still open after the shutdown grace",
                    len(self._connections),
                )
            for connection in list(self._connections):
                connection.drop("shutdown")
            handlers.cancel_scope.cancel()

    async def _accept(
        self, listener: trio.SocketListener, sock: socket.socket, handlers: trio.Nursery
    ) -> None:
        async with listener:  # closed when accepting ends: new clients are refused from then on
            while True:
                await self._accept_one(listener, handlers)
                self._accept_waiting(sock, handlers)

    def _accept_waiting(self, sock: socket.socket, handlers: trio.Nursery) -> None:
        """Every connection already waiting, while there is room, without a checkpoint each.

        A busy server schedules its accepting task once per round of all its
        runnable tasks: one connection per round leaves a burst of clients in
        the kernel's queue for seconds. ``sock`` is the listener's own
        socket, non-blocking since trio took it.
        """
        while self._slots.value > 0:
            try:
                client, _ = sock.accept()
            except OSError:  # none waiting (EAGAIN), or none possible now: the awaited path
                return
            self._slots.acquire_nowait()
            handlers.start_soon(
                self._serve, trio.SocketStream(trio.socket.from_stdlib_socket(client))
            )

    async def _accept_one(self, listener: trio.SocketListener, handlers: trio.Nursery) -> None:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in _RESOURCE_ERRORS:
                raise
            if not self._starved:
                self._starved = True
                logger.warning(
                    "cannot accept connections (%s): retrying every %ss; lower "
                    "--max-connections below the file-descriptor limit",
                    errno.errorcode[exc.errno],
                    _ACCEPT_RETRY_DELAY,
                )
            await trio.sleep(_ACCEPT_RETRY_DELAY)
            return
        self._starved = False
        # At the limit, this one client waits (the others, in the kernel's
        # queue) until a connection ends; an idle one is ended to make room.
        try:
            if self._slots.value == 0:
                self._reclaim_idle()
            await self._slots.acquire()
        except BaseException:
            stream.socket.close()
            raise
        handlers.start_soon(self._serve, stream)

    async def _serve(self, stream: trio.SocketStream) -> None:
        connection = ClientConnection(
            self._wrapped,
            self._config,
            self._context,
            stream,
            stall_timeout=self._limits.client_stall_timeout,
            http2=self._limits.http2,
            metrics=self._app.metrics,
            drops=self._drops,
        )
        self._connections.add(connection)
        try:
            await connection.serve()
        except Exception as exc:
            # One line per fault, naming only its type: hypercorn's exceptions
            # carry the request, whose headers (an API key among them) must not
            # reach the log at WARNING.
            while isinstance(exc, ExceptionGroup):
                exc = exc.exceptions[0]
            left_out = self._faults.take("hypercorn")
            if left_out is not None:
                logger.warning(
                    "closed an HTTP connection after a protocol fault inside hypercorn (%s.%s)%s",
                    type(exc).__module__,
                    type(exc).__qualname__,
                    f"; {left_out} more such closes not logged before it" if left_out else "",
                )
            logger.debug("the connection's failure, in full", exc_info=True)
        finally:
            # hypercorn closes the socket with awaits, which a cancelled server skips.
            stream.socket.close()
            self._connections.discard(connection)
            self._slots.release()

    def _reclaim_idle(self) -> None:
        """At the limit, make room: drop the oldest connection with no request in flight.

        As nginx reuses its idle keep-alive connections: otherwise clients
        that connect and send nothing (or keep a connection idle) hold every
        slot for the keep-alive timeout, and ``/health`` waits behind them.
        """
        for connection in self._connections:
            if connection.idle and connection.dropped is None:
                connection.drop("idle")
                return
