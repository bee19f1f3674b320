"""trio-sglang: cancel SGLang generation requests correctly and fast, with trio.

The public API lives here; the ``_modules`` behind it are private. The
simulator's names are imported only when first asked for: a worker in front of
the real SGLang never loads the SimEngine.
"""

from typing import TYPE_CHECKING, Any

from ._asyncio_bridge._guest import run_as_guest
from ._core._context import RequestContext
from ._core._disagg import PrefillFailed, PrefillPeer, Role
from ._core._in_process_prefill import InProcessPrefill
from ._core._policy import AbortPolicy
from ._core._reports import EngineFault, WorkerObserver
from ._core._worker import PreparedRequest, ResponseStream, Worker, open_worker
from ._engine import ChatTemplating, Engine, EngineFeatures, EngineStream, RequestPhase
from ._errors import EngineError, EngineShutdown, InvalidRequest
from ._kv_rooms import BootstrapAddr, KVRooms, RoomEvent
from ._request._parse import OutputMode
from ._sglang._semantics import UnsupportedSGLang
from ._sglang._sglang_engine import SGLangEngine
from ._version import __version__

if TYPE_CHECKING:
    from .sim import (
        DisaggregationMode,
        SimDisaggTiming,
        SimEngine,
        SimKVRooms,
        TraceEvent,
        TraceKind,
    )

#: The names ``trio_sglang.sim`` defines, imported from it on first use.
_FROM_SIM = frozenset(
    {"DisaggregationMode", "SimDisaggTiming", "SimEngine", "SimKVRooms", "TraceEvent", "TraceKind"}
)


def __getattr__(name: str) -> Any:
    if name in _FROM_SIM:
        from . import sim

        value = getattr(sim, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM_SIM})


__all__ = [
    "AbortPolicy",
    "BootstrapAddr",
    "ChatTemplating",
    "DisaggregationMode",
    "Engine",
    "EngineError",
    "EngineFault",
    "EngineFeatures",
    "EngineShutdown",
    "EngineStream",
    "InProcessPrefill",
    "InvalidRequest",
    "KVRooms",
    "OutputMode",
    "PrefillFailed",
    "PrefillPeer",
    "PreparedRequest",
    "RequestContext",
    "RequestPhase",
    "ResponseStream",
    "Role",
    "RoomEvent",
    "SGLangEngine",
    "SimDisaggTiming",
    "SimEngine",
    "SimKVRooms",
    "TraceEvent",
    "TraceKind",
    "UnsupportedSGLang",
    "Worker",
    "WorkerObserver",
    "__version__",
    "open_worker",
    "run_as_guest",
]
