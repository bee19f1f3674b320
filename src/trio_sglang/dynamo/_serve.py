"""``serve_dynamo_worker``: a worker registered in Dynamo's runtime, and its ordered shutdown.

The order is ``serve``'s (hypercorn's trio worker): the engine and the worker
first; the endpoint, and the nursery its requests run in, after them and
stopped before them. At shutdown:

1. the endpoint instance and the model are unregistered, so the frontend
   and the router send nothing more here;
2. open streams get the grace to finish; what is still open then is ended
   (its client gets ``EngineShutdown``, which Dynamo's frontend may migrate);
3. the worker is left: pending cleanup gets its own grace, then the engine
   closes;
4. the runtime shuts down, and with it the endpoint's server and its
   discovery entries.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any, Protocol

import trio

from .._core._policy import AbortPolicy
from .._core._reports import WorkerObserver
from .._core._worker import Worker, open_worker
from .._engine import Engine
from ._bridge import RequestBridge, RequestsObserver
from ._config import DynamoEndpoint, RuntimePlanes
from ._hosts import AsyncioHost
from ._mapping import TOKENS
from ._text import text_mode

__all__ = ["DynamoObserver", "Hurry", "RuntimeStopped", "serve_dynamo_worker"]

logger = logging.getLogger("trio_sglang.dynamo")

#: Past this, unregistering is left to the runtime's shutdown (which removes the entries too).
_UNREGISTER_TIMEOUT = 5.0

#: How long the runtime's endpoint server gets to stop once told to.
_RUNTIME_CLOSE_TIMEOUT = 5.0

#: The key the worker's ``capabilities()`` are published under in the model's runtime config.
CAPABILITIES_KEY = "trio_sglang"


class RuntimeStopped(Exception):
    """Dynamo's runtime stopped serving the worker's endpoint while the worker was running."""


class DynamoObserver(RequestsObserver, WorkerObserver, Protocol):
    """Hears each request's end and each cleanup's (``DynamoMetrics``), and watches the worker."""

    def watch(self, worker: Worker) -> None: ...


def _runtime_api() -> Any:
    """Dynamo's runtime, or an ``ImportError`` that says where it comes from."""
    try:
        import dynamo.llm
        import dynamo.runtime
    except ImportError as exc:
        raise ImportError(
            f"a Dynamo worker needs Dynamo's runtime: pip install 'trio-sglang[dynamo]' ({exc})"
        ) from exc
    return dynamo


class Hurry:
    """Ends the shutdown's graces at once (a second signal): open streams, then pending cleanup."""

    def __init__(self, bridge: RequestBridge, worker: Worker) -> None:
        self._bridge = bridge
        self._worker = worker

    def __call__(self) -> None:
        self._bridge.hurry()
        self._worker.end_grace()


async def serve_dynamo_worker(
    engine: Engine,
    endpoint: DynamoEndpoint,
    host: AsyncioHost,
    shutdown: trio.Event,
    *,
    planes: RuntimePlanes | None = None,
    policy: AbortPolicy | None = None,
    observer: DynamoObserver | None = None,
    task_status: trio.TaskStatus[Hurry] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``engine`` as a Dynamo backend at ``endpoint`` until ``shutdown`` is set.

    ``host`` is the asyncio loop the runtime runs on (see ``run_hosted``);
    ``planes`` default to Dynamo's environment variables. Reports started,
    with a ``Hurry`` to cut the shutdown short, once the model is registered.
    Open streams get ``policy.shutdown_grace`` to finish at shutdown, and
    pending cleanup gets it again after them (``open_worker``).
    """
    api = _runtime_api()
    planes = RuntimePlanes.from_env() if planes is None else planes
    policy = AbortPolicy() if policy is None else policy
    runtime = api.runtime.DistributedRuntime(
        host.loop,
        planes.discovery_backend,
        planes.request_plane,
        event_plane=planes.event_plane,
        response_plane=planes.response_plane,
    )
    async with trio.open_nursery() as serving:
        try:
            served = runtime.endpoint(endpoint.path)
            async with open_worker(engine, policy=policy, observer=observer) as worker:
                if observer is not None:
                    observer.watch(worker)
                mode = (
                    TOKENS
                    if endpoint.model_input == "tokens"
                    else text_mode(engine, endpoint.model_name)
                )
                async with trio.open_nursery() as requests:
                    bridge = RequestBridge(worker, requests, host.loop, observer, mode)
                    serving.start_soon(_serve_endpoint, host, served, bridge, shutdown)
                    context_length = worker.features.context_length
                    await host.aio(
                        partial(_register, api, served, endpoint, worker, context_length)
                    )
                    logger.info(
                        "serving %s at %s (%s input, %s discovery)",
                        endpoint.model_name,
                        endpoint.path,
                        endpoint.model_input,
                        planes.discovery_backend,
                    )
                    task_status.started(Hurry(bridge, worker))
                    await shutdown.wait()
                    await _unregister(host, api, served)
                    bridge.close()
                    left = await bridge.drain(trio.current_time() + policy.shutdown_grace)
                    if left:
                        logger.warning("%d streams still open at the end of the grace: ended", left)
                    requests.cancel_scope.cancel()
        finally:
            runtime.shutdown()  # ends serve_endpoint, and the runtime's own tasks
            serving.cancel_scope.deadline = trio.current_time() + _RUNTIME_CLOSE_TIMEOUT


async def _serve_endpoint(
    host: AsyncioHost, served: Any, bridge: RequestBridge, shutdown: trio.Event
) -> None:
    """The endpoint's server, until the runtime stops it; ``RuntimeStopped`` if it stops first.

    Dynamo's runtime shuts itself down when it cannot renew its discovery
    lease (etcd unreachable for longer than ``ETCD_LEASE_TTL``): the frontend
    has dropped this worker by then, and nothing registers it again. The
    process ends then, as Dynamo's frontend does, so that whatever supervises
    it starts it afresh; so it does when the runtime fails to register the
    endpoint in the first place (etcd unreachable just then).
    """
    try:
        await host.aio(partial(served.serve_endpoint, bridge.generate))
    except Exception as exc:  # the runtime's own: discovery unreachable at registration, ...
        if shutdown.is_set():
            raise
        raise RuntimeStopped(f"Dynamo's runtime could not serve the endpoint: {exc}") from exc
    if not shutdown.is_set():
        raise RuntimeStopped(
            "Dynamo's runtime stopped serving the endpoint by itself (its discovery lease "
            "lost?): the frontend no longer routes here"
        )


async def _register(
    api: Any, served: Any, endpoint: DynamoEndpoint, worker: Worker, context_length: object
) -> None:
    """The model, with the engine's context length and the worker's capabilities.

    With ``text`` input the card has no model assets: the frontend then
    neither needs nor reads a tokenizer, and hands the worker the client's
    body for both routes.
    """
    llm = api.llm
    config = llm.ModelRuntimeConfig()
    if isinstance(context_length, int):
        config.context_length = context_length  # the frontend refuses longer prompts itself
    config.set_engine_specific(CAPABILITIES_KEY, json.dumps(worker.capabilities()))
    text = endpoint.model_input == "text"
    await llm.register_model(
        llm.ModelInput.Text if text else llm.ModelInput.Tokens,
        llm.ModelType.Chat | llm.ModelType.Completions,
        served,
        str(endpoint.model_path),
        endpoint.model_name,
        worker_type=llm.WorkerType.Aggregated,
        runtime_config=config,
        skip_model_assets=text,
    )


async def _unregister(host: AsyncioHost, api: Any, served: Any) -> None:
    """Out of discovery first: no new request reaches this worker from here on."""
    failed: Exception | None = None
    with trio.move_on_after(_UNREGISTER_TIMEOUT, shield=True) as bounded:
        try:
            await host.aio(served.unregister_endpoint_instance)
            await host.aio(partial(api.llm.unregister_model, served))
        except Exception as exc:  # the shutdown goes on: the runtime's removes the entries
            failed = exc
    if bounded.cancelled_caught or failed is not None:
        why = f"failed ({failed!r})" if failed else f"took over {_UNREGISTER_TIMEOUT}s"
        logger.warning("unregistering %s: the runtime's shutdown removes the entries", why)
