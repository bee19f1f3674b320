"""trio-sglang as a backend of NVIDIA Dynamo's distributed runtime (the ``dynamo`` extra).

``serve_dynamo_worker`` registers an engine's worker at a Dynamo endpoint
(``WorkerType.Aggregated``; ``ModelInput.Tokens`` by default: Dynamo's
frontend tokenizes, and its router routes), serves each request through
``Worker.generate``, and turns Dynamo's stop and kill into
``RequestContext.stop()`` and ``kill()`` the moment they fire. With
``DynamoEndpoint(model_input="text")`` it registers ``ModelInput.Text``
instead: the worker gets the client's OpenAI request and answers OpenAI
chunks, made by the plans of ``serve``'s OpenAI routes, so the frontend
needs no tokenizer.
``run_hosted`` runs it beside the runtime's asyncio loop, trio as uvloop's
guest or over trio-asyncio. ``trio-sglang dynamo-worker`` is the process
around it. Importing this package needs no Dynamo; serving does. Each name
is imported from its module when first asked for, so that the command line,
which builds ``dynamo-worker``'s options from ``_worker_options`` on every start,
pays for nothing else here.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._config import (
        MODEL_INPUTS,
        SIM_MODEL_PATH,
        DynamoEndpoint,
        ModelInputKind,
        RuntimePlanes,
    )
    from ._hosts import HOSTS, AsyncioHost, HostKind, run_hosted
    from ._serve import CAPABILITIES_KEY, DynamoObserver, Hurry, serve_dynamo_worker

#: Each public name, and the module that defines it.
_HOMES = {
    **dict.fromkeys(
        ("MODEL_INPUTS", "SIM_MODEL_PATH", "DynamoEndpoint", "ModelInputKind", "RuntimePlanes"),
        "_config",
    ),
    **dict.fromkeys(("HOSTS", "AsyncioHost", "HostKind", "run_hosted"), "_hosts"),
    **dict.fromkeys(
        ("CAPABILITIES_KEY", "DynamoObserver", "Hurry", "serve_dynamo_worker"), "_serve"
    ),
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


__all__ = [
    "CAPABILITIES_KEY",
    "HOSTS",
    "MODEL_INPUTS",
    "SIM_MODEL_PATH",
    "AsyncioHost",
    "DynamoEndpoint",
    "DynamoObserver",
    "HostKind",
    "Hurry",
    "ModelInputKind",
    "RuntimePlanes",
    "run_hosted",
    "serve_dynamo_worker",
]
