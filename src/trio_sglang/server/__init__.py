"""The HTTP server: ``trio-sglang serve`` (needs the ``serve`` extra).

SGLang's native ``POST /generate``, OpenAI's ``POST /v1/completions`` and
``POST /v1/chat/completions`` (server-sent events when ``stream`` is true),
``GET /health``, ``GET /v1/models``, ``GET /capabilities`` and
``GET /metrics``, on hypercorn's trio worker. A client that disconnects stops
its request at once.
"""

from ._app import DEFAULT_MAX_BODY_BYTES, ServerApp
from ._metrics import ServerMetrics
from ._run import serve

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ServerApp", "ServerMetrics", "serve"]
