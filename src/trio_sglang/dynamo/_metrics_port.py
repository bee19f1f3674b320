"""The worker's ``trio_sglang_*`` metrics, as ``serve`` exports them, on a port of their own.

A Dynamo worker has no HTTP server of ours, so ``--metrics-port`` serves
``GET /metrics`` (hypercorn, trio worker) from the same ``ServerMetrics``
that ``serve`` uses: live requests at the engine, open streams, pending
cleanups, abort delays, and requests by outcome under ``endpoint="dynamo"``.
Beside it, ``GET /live_requests`` answers the engine's live requests as a
bare number: for a drain script, or a benchmark, that polls far faster than
a whole scrape renders.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from .._core._worker import Worker
from ..server import ServerMetrics
from ._bridge import Outcome

if TYPE_CHECKING:
    from hypercorn.typing import ASGIFramework

__all__ = ["DynamoMetrics", "serve_metrics"]


class DynamoMetrics(ServerMetrics):
    """``ServerMetrics``, also told how each Dynamo request ended."""

    def __init__(self) -> None:
        super().__init__()
        self._worker: Worker | None = None

    def watch(self, worker: Worker) -> None:
        super().watch(worker)
        self._worker = worker

    def live_requests(self) -> int:
        """The engine's live requests (0 before a worker is watched)."""
        return 0 if self._worker is None else self._worker.engine.live_requests()

    def request_ended(self, outcome: Outcome, *, tokens_sent: bool) -> None:
        self.requests.labels("dynamo", outcome).inc()
        if outcome == "cancelled":
            self.cancellations.labels("mid_stream" if tokens_sent else "before_first_token").inc()


async def serve_metrics(
    metrics: DynamoMetrics,
    host: str,
    port: int,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` on ``host:port`` until ``shutdown``; reports the bound URLs."""
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 1.0

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # nothing to start or stop
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        status, kind, body = 200, b"text/plain", b""
        if scope["method"] not in ("GET", "HEAD"):
            status, body = 405, b"GET only\n"
        elif scope["path"] == "/metrics":
            kind, body = b"text/plain; version=0.0.4", metrics.render()
        elif scope["path"] == "/live_requests":
            body = b"%d\n" % metrics.live_requests()
        else:
            status, body = 404, b"not found: GET /metrics or /live_requests\n"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", kind), (b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})

    await serve(
        cast("ASGIFramework", app), config, shutdown_trigger=shutdown.wait, task_status=task_status
    )
