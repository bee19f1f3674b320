"""The SimEngine: SGLang 0.5.23's abort semantics on the trio clock, with no GPU.

The embedded default engine, and what the tests and benchmarks judge a
lifecycle against: its tokenizer manager, scheduler, prefill/decode queues,
KV rooms and trace. The lifecycle knows it only through the ``Engine``
protocol and never imports it; the server gets it from the CLI's engine
factory.
"""

from .._kv_rooms import BootstrapAddr, KVRooms, RoomEvent
from ._sim_disagg import DisaggregationMode, SimDisaggTiming, SimKVRooms
from ._sim_engine import SimEngine
from ._trace import Trace, TraceEvent, TraceKind

__all__ = [
    "BootstrapAddr",
    "DisaggregationMode",
    "KVRooms",
    "RoomEvent",
    "SimDisaggTiming",
    "SimEngine",
    "SimKVRooms",
    "Trace",
    "TraceEvent",
    "TraceKind",
]
