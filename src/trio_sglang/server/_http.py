"""The HTTP side of ``serve``: hypercorn's trio connection server, each connection isolated.

This is hypercorn's own trio worker loop (listen, accept into a handler
nursery, give the handlers a grace deadline at shutdown), kept here for one
difference: a connection that fails inside hypercorn (its HTTP/2 code can
raise on a client's probe, as sglang-router's gRPC health check does) ends
that connection only, instead of the whole server process.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import cast

import trio
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ASGIFramework, ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app

from ._app import ServerApp

__all__ = ["ListenError", "serve_http"]

logger = logging.getLogger("trio_sglang.server")


class ListenError(OSError):
    """The server could not listen where it was told (a port in use, an address not here)."""


async def serve_http(
    app: ServerApp,
    config: Config,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until ``shutdown`` is set; report the URLs once listening."""
    wrapped = wrap_app(cast("ASGIFramework", app), config.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)
    try:
        sockets = config.create_sockets()  # binds
    except OSError as exc:
        where = ", ".join(config.bind)
        raise ListenError(f"cannot listen on {where}: {exc.strerror or exc}") from exc
    listeners = []
    urls = []
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        urls.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
    handle = partial(_connection, wrapped, config, context)
    async with trio.open_nursery() as handlers:
        async with trio.open_nursery() as accepting:
            accepting.start_soon(
                partial(trio.serve_listeners, handle, listeners, handler_nursery=handlers)
            )
            task_status.started(urls)
            await shutdown.wait()
            app.close()  # end the responses being generated; their cleanup is the worker's
            accepting.cancel_scope.cancel()
        await context.terminated.set()  # idle keep-alive connections close
        handlers.cancel_scope.deadline = trio.current_time() + config.graceful_timeout


async def _connection(
    app: AppWrapper, config: Config, context: WorkerContext, stream: trio.SocketStream
) -> None:
    try:
        # hypercorn annotates the stream as an SSLStream; its own loop passes
        # plain SocketStreams, as here.
        await TCPServer(app, config, context, ConnectionState({}), stream)  # type: ignore[arg-type]
    except Exception:
        logger.warning("an HTTP connection failed inside hypercorn; closed it", exc_info=True)
