"""trio-sglang as a backend of NVIDIA Dynamo's distributed runtime (the ``dynamo`` extra).

``serve_dynamo_worker`` registers an engine's worker at a Dynamo endpoint
(``ModelInput.Tokens``, ``WorkerType.Aggregated``: Dynamo's frontend
tokenizes, and its router routes), serves each request through
``Worker.generate(..., output="tokens")``, and turns Dynamo's stop and kill
into ``RequestContext.stop()`` and ``kill()`` the moment they fire.
``run_hosted`` runs it beside the runtime's asyncio loop, trio as uvloop's
guest or over trio-asyncio. ``trio-sglang dynamo-worker`` is the process
around it. Importing this package needs no Dynamo; serving does.
"""

from ._config import SIM_MODEL_PATH, DynamoEndpoint, RuntimePlanes
from ._hosts import HOSTS, AsyncioHost, HostKind, run_hosted
from ._serve import CAPABILITIES_KEY, DynamoObserver, Hurry, serve_dynamo_worker

__all__ = [
    "CAPABILITIES_KEY",
    "HOSTS",
    "SIM_MODEL_PATH",
    "AsyncioHost",
    "DynamoEndpoint",
    "DynamoObserver",
    "HostKind",
    "Hurry",
    "RuntimePlanes",
    "run_hosted",
    "serve_dynamo_worker",
]
