"""``serve``: the worker, the HTTP server over it, and a graceful, ordered shutdown.

The order follows hypercorn's own trio worker: the engine and the worker are
entered first; the HTTP server (and the nursery its handlers run in) is
started after them and stopped before them. On SIGINT or SIGTERM the app
stops taking requests and ends every response (their engine-side cleanup
goes on in the worker), hypercorn closes its connections, and then leaving
the worker gives pending cleanup its grace before the engine closes.
"""

from __future__ import annotations

import logging
import signal

import trio
from hypercorn.config import Config

from .._disagg import PrefillPeer
from .._engine import Engine
from .._kv_rooms import HostedKVRooms
from .._policy import AbortPolicy
from .._worker import Worker, open_worker
from ._app import DEFAULT_MAX_BODY_BYTES, ServerApp
from ._http import serve_http
from ._metrics import ServerMetrics

__all__ = ["serve"]

logger = logging.getLogger("trio_sglang.server")


async def serve(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model: str = "trio-sglang",
    policy: AbortPolicy | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    handle_signals: bool = True,
    shutdown: trio.Event | None = None,
    prefill: PrefillPeer | None = None,
    kv_rooms: HostedKVRooms | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until SIGINT/SIGTERM (or ``shutdown`` is set); reports the bound URLs.

    ``task_status.started`` receives the URLs the server listens on (useful
    with ``port=0``). Prefill/decode disaggregation: ``prefill`` is a decode
    worker's prefill peer (``open_worker(prefill=...)``, e.g. ``HTTPPrefill``);
    ``kv_rooms``, the rooms of a prefill ``SimEngine`` (its ``SimKVRooms``),
    is served to decode servers under ``/bootstrap/rooms/`` (SGLang's
    bootstrap server, on this server's HTTP port; see ``_kv_rooms.py``).
    """
    shutdown = trio.Event() if shutdown is None else shutdown
    metrics = ServerMetrics()
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    # hypercorn's default accept queue holds 100 connections: a burst of clients
    # connecting at once (1,000 in `nox -s load`) overflows it while the loop is
    # busy, and the kernel drops their SYNs (retried 1, 3, 7 s later) or resets
    # them. The kernel caps this at net.core.somaxconn (4096 on current Linux).
    config.backlog = 4096
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # through logging, once
    config.graceful_timeout = 1.0  # streams are already ended by then
    async with open_worker(engine, policy=policy, observer=metrics, prefill=prefill) as worker:
        app = ServerApp(
            worker, metrics, model=model, max_body_bytes=max_body_bytes, kv_rooms=kv_rooms
        )
        async with trio.open_nursery() as nursery:

            async def http(task_status: trio.TaskStatus[list[str]]) -> None:
                try:
                    await serve_http(app, config, shutdown, task_status=task_status)
                finally:  # the connections are done: stop watching signals
                    nursery.cancel_scope.cancel()

            if handle_signals:
                nursery.start_soon(_signals_set, shutdown)
            urls: list[str] = await nursery.start(http)
            # The URL right after "on", where scripts look for it (the tests'
            # and the load benchmark's `serving \S+ on (http://\S+)`).
            logger.info("serving %s on %s (%s)", model, ", ".join(urls), _describe(worker))
            task_status.started(urls)
        logger.info("HTTP server stopped; finishing engine-side cleanup")


def _describe(worker: Worker) -> str:
    """``role prefill, engine sim``: what this server is, for its start-up line."""
    capabilities = worker.capabilities()
    return f"role {capabilities['role']}, engine {capabilities['engine']['kind']}"


async def _signals_set(event: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logger.info("received %s: shutting down", signal.Signals(signum).name)
            event.set()
            return
