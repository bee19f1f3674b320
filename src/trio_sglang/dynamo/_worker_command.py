"""``trio-sglang dynamo-worker``: a worker process in Dynamo, from signals to exit status."""

from __future__ import annotations

import argparse
import importlib.util
import logging
from functools import partial
from pathlib import Path

import trio

from .._cli._engines import EngineOptions, open_engine
from .._core._policy import AbortPolicy
from ..server._serving import ForcedShutdown, ShutdownSignals
from ._config import SIM_MODEL_PATH, DynamoEndpoint, RuntimePlanes
from ._hosts import AsyncioHost, HostKind, run_hosted
from ._metrics_port import DynamoMetrics, serve_metrics
from ._serve import serve_dynamo_worker

__all__ = ["Refused", "run_command"]

logger = logging.getLogger("trio_sglang.dynamo")


class Refused(Exception):
    """A configuration the worker cannot run with; the CLI prints it and exits 2."""


def run_command(args: argparse.Namespace, engine: EngineOptions) -> None:
    """Run the worker until SIGINT/SIGTERM; ``ForcedShutdown`` after a second one."""
    if importlib.util.find_spec("dynamo") is None:
        raise Refused("it needs Dynamo's runtime: pip install 'trio-sglang[dynamo]'")
    if args.engine == "sglang" and not args.model_path:
        raise Refused("--engine sglang needs --model-path")
    try:
        endpoint = DynamoEndpoint(
            model_name=args.model_name,
            model_path=SIM_MODEL_PATH if args.model_path is None else Path(args.model_path),
            namespace=args.namespace,
            component=args.component,
            endpoint=args.endpoint,
            model_input=args.model_input,
        )
        planes = RuntimePlanes.from_env()
    except ValueError as exc:
        raise Refused(str(exc)) from None
    kind: HostKind = args.loop or "guest"
    if kind == "trio-asyncio" and importlib.util.find_spec("trio_asyncio") is None:
        raise Refused("--loop trio-asyncio needs trio-asyncio: pip install 'trio-sglang[asyncio]'")
    policy = AbortPolicy(
        shutdown_grace=args.shutdown_grace, engine_close_timeout=args.engine_close_timeout
    )
    main = partial(_run, engine, endpoint, planes, policy, args.metrics_host, args.metrics_port)
    run_hosted(kind, main)


async def _run(
    options: EngineOptions,
    endpoint: DynamoEndpoint,
    planes: RuntimePlanes,
    policy: AbortPolicy,
    metrics_host: str,
    metrics_port: int | None,
    host: AsyncioHost,
) -> None:
    shutdown = trio.Event()
    signals = ShutdownSignals(shutdown)
    metrics = DynamoMetrics()
    async with trio.open_nursery() as watching:
        # From the start to the engine's close: a second signal is never lost.
        watching.start_soon(signals.watch)
        # With trio as uvloop's guest, SGLang's code runs on the runtime's loop too.
        on = host.loop if host.kind == "guest" else None
        async with (
            open_engine(options, asyncio_loop=on) as (engine, _),
            trio.open_nursery() as serving,
        ):
            if metrics_port is not None:
                urls = await serving.start(
                    serve_metrics, metrics, metrics_host, metrics_port, shutdown
                )
                logger.info("metrics on %s/metrics", urls[0])
            hurry = await serving.start(
                partial(
                    serve_dynamo_worker,
                    engine,
                    endpoint,
                    host,
                    shutdown,
                    planes=planes,
                    policy=policy,
                    observer=metrics,
                )
            )
            signals.on_hurry(hurry)
        watching.cancel_scope.cancel()
    if signals.forced is not None:
        raise ForcedShutdown(signals.forced)
