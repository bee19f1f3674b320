"""``serve``: the worker, the HTTP server over it, and a graceful, ordered shutdown.

The order follows hypercorn's own trio worker: the engine and the worker are
entered first; the HTTP server (and the nursery its handlers run in) is
started after them and stopped before them. On SIGINT or SIGTERM the app
stops taking requests and ends every response (their engine-side cleanup
goes on in the worker), hypercorn closes its connections, and then leaving
the worker gives pending cleanup its grace before the engine closes. A
second signal means "now": the grace ends at once (connections are reset,
pending cleanup is cancelled), the engine still closes, and ``serve``
raises ``ForcedShutdown``.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial

import trio
from hypercorn.config import Config

from .._core._disagg import PrefillPeer
from .._core._policy import AbortPolicy
from .._core._worker import Worker, open_worker
from .._engine import Engine, HostsApp
from .._hosted_app import HostedApp
from .._kv_rooms import HostedKVRooms
from .._limits import ServerLimits
from ._app import ServerApp
from ._http import HTTPServer
from ._metrics import ServerMetrics

__all__ = ["ForcedShutdown", "ShutdownSignals", "serve"]

logger = logging.getLogger("trio_sglang.server")


class ForcedShutdown(Exception):
    """A second SIGINT or SIGTERM cut the shutdown grace short; raised once all is closed."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by a second {signal.Signals(signum).name}")
        self.signum = signum


async def serve(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model: str | Sequence[str] = "trio-sglang",
    policy: AbortPolicy | None = None,
    limits: ServerLimits | None = None,
    handle_signals: bool = True,
    shutdown: trio.Event | None = None,
    prefill: PrefillPeer | None = None,
    kv_rooms: HostedKVRooms | None = None,
    enable_cache_report: bool = False,
    host_app: bool = False,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until SIGINT/SIGTERM (or ``shutdown`` is set); reports the bound URLs.

    ``task_status.started`` receives the URLs the server listens on (useful
    with ``port=0``). ``limits`` bounds what clients can make the server hold
    (``ServerLimits``); the shutdown grace and the engine's close are
    ``policy``'s. ``model`` is the served model's name, or its names (the
    first its own, the others aliases), which ``/v1/models`` lists.
    Prefill/decode disaggregation: ``prefill`` is a decode worker's prefill
    peer (``open_worker(prefill=...)``, e.g. ``HTTPPrefill``);
    ``kv_rooms``, the rooms of a prefill ``SimEngine`` (its ``SimKVRooms``),
    is served to decode servers under ``/bootstrap/rooms/`` (SGLang's
    bootstrap server, on this server's HTTP port; see ``_kv_rooms_http.py``).
    ``enable_cache_report`` (SGLang's ``--enable-cache-report``): OpenAI usage
    carries ``prompt_tokens_details.cached_tokens``, the engine's count of
    prompt tokens its prefix cache held. ``host_app``: an engine with an HTTP
    application of its own (``HostsApp``: SGLang's server) serves every route
    but ``/abort_request``, ``/metrics`` and ``/capabilities`` with it, its
    requests through the worker's lifecycle.
    """
    shutdown = trio.Event() if shutdown is None else shutdown
    limits = ServerLimits() if limits is None else limits
    served: list[str] = []  # the URL the server listens on, once it does
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
    config.keep_alive_timeout = limits.keep_alive_timeout
    signals = ShutdownSignals(shutdown)
    async with trio.open_nursery() as watching:
        if handle_signals:  # from the start to the engine's close: a second one is never lost
            watching.start_soon(signals.watch)
        async with (
            open_worker(engine, policy=policy, observer=metrics, prefill=prefill) as worker,
            _hosted_app(engine, host_app, served) as hosted,
        ):
            app = ServerApp(
                worker,
                metrics,
                model=model,
                limits=limits,
                kv_rooms=kv_rooms,
                prefill=prefill,
                enable_cache_report=enable_cache_report,
                hosted=hosted,
            )
            http = HTTPServer(app, config, limits)
            signals.on_hurry(http.hurry, worker.end_grace)
            async with trio.open_nursery() as serving:
                urls: list[str] = await serving.start(partial(http.run, shutdown))
                served.append(urls[0])
                # The URL right after "on", where scripts look for it (the tests'
                # and the load benchmark's `serving \S+ on (http://\S+)`).
                names = ",".join(app.models)
                logger.info("serving %s on %s (%s)", names, ", ".join(urls), _describe(worker))
                task_status.started(urls)
            logger.info("HTTP server stopped; finishing engine-side cleanup")
        watching.cancel_scope.cancel()
    if signals.forced is not None:
        raise ForcedShutdown(signals.forced)


@asynccontextmanager
async def _hosted_app(
    engine: Engine, wanted: bool, served: list[str]
) -> AsyncIterator[HostedApp | None]:
    """The engine's own HTTP application, if it is wanted, for the block."""
    if not wanted:
        yield None
        return
    if not isinstance(engine, HostsApp):
        raise TypeError(f"the {type(engine).__name__} has no HTTP application of its own")
    async with engine.hosted_app(lambda: served[0] if served else None) as hosted:
        yield hosted


def _describe(worker: Worker) -> str:
    """``role prefill, engine sim``: what this server is, for its start-up line."""
    capabilities = worker.capabilities()
    return f"role {capabilities['role']}, engine {capabilities['engine']['kind']}"


class ShutdownSignals:
    """SIGINT and SIGTERM: the first sets ``shutdown``, a second one calls the hurry hooks.

    Watched until the engine has closed, so that no signal ever meets
    Python's default handler (a traceback, or death by SIGTERM mid-cleanup).
    """

    def __init__(self, shutdown: trio.Event) -> None:
        self.shutdown = shutdown
        self.forced: int | None = None
        self._hooks: list[Callable[[], None]] = []

    def on_hurry(self, *hooks: Callable[[], None]) -> None:
        self._hooks.extend(hooks)

    async def watch(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
            async for signum in received:
                name = signal.Signals(signum).name
                if not self.shutdown.is_set():
                    logger.info("received %s: shutting down (a second signal: at once)", name)
                    self.shutdown.set()
                elif self.forced is None:
                    logger.warning(
                        "received %s again: ending the shutdown grace now; open "
                        "connections are reset and pending cleanup is cancelled",
                        name,
                    )
                    self.forced = signum
                    for hook in self._hooks:
                        hook()
