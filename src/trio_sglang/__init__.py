"""trio-sglang: cancel SGLang generation requests correctly and fast, with trio.

The public API lives here; the ``_modules`` behind it are private.
"""

from ._context import RequestContext
from ._disagg import PrefillFailed, PrefillPeer, Role
from ._engine import ChatTemplating, Engine, EngineStream, RequestPhase
from ._errors import EngineError, EngineShutdown, InvalidRequest
from ._faults import EngineFault
from ._in_process_prefill import InProcessPrefill
from ._observer import WorkerObserver
from ._policy import AbortPolicy
from ._request import OutputMode
from ._sglang_engine import SGLangEngine
from ._sglang_semantics import UnsupportedSGLang
from ._version import __version__
from ._worker import ResponseStream, Worker, open_worker
from .sim import (
    BootstrapAddr,
    DisaggregationMode,
    KVRooms,
    RoomEvent,
    SimDisaggTiming,
    SimEngine,
    SimKVRooms,
    TraceEvent,
    TraceKind,
)

__all__ = [
    "AbortPolicy",
    "BootstrapAddr",
    "ChatTemplating",
    "DisaggregationMode",
    "Engine",
    "EngineError",
    "EngineFault",
    "EngineShutdown",
    "EngineStream",
    "InProcessPrefill",
    "InvalidRequest",
    "KVRooms",
    "OutputMode",
    "PrefillFailed",
    "PrefillPeer",
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
]
