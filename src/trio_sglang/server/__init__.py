"""The HTTP server: ``trio-sglang serve`` (needs the ``serve`` extra).

SGLang's native ``POST /generate`` and ``POST /abort_request`` (by exact
id), OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions``
(server-sent events when ``stream`` is true), ``GET /health``,
``GET /v1/models``, ``GET /capabilities`` and ``GET /metrics``, on
hypercorn's trio worker. A client that disconnects stops its request at
once, and so does one that stops reading: every resource a client can make
the server hold is bounded by ``ServerLimits``, and a second SIGINT or
SIGTERM ends the shutdown at once (``ForcedShutdown``).

Prefill/decode disaggregation across processes: ``HTTPPrefill`` is a prefill
server as a decode worker's ``PrefillPeer``; a prefill server on the
SimEngine serves its KV rooms (``serve(kv_rooms=...)``) and a decode
SimEngine reaches them with ``open_http_kv_rooms()``.
"""

from .._limits import ServerLimits
from ._app import ServerApp
from ._http import ListenError
from ._kv_rooms_http import HTTPKVRooms, open_http_kv_rooms
from ._metrics import ServerMetrics
from ._prefill_peer import HTTPPrefill
from ._serving import ForcedShutdown, serve

__all__ = [
    "ForcedShutdown",
    "HTTPKVRooms",
    "HTTPPrefill",
    "ListenError",
    "ServerApp",
    "ServerLimits",
    "ServerMetrics",
    "open_http_kv_rooms",
    "serve",
]
