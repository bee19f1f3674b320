"""The request plans: OpenAI's and SGLang's native endpoints, without I/O.

A plan turns a client's body into the SGLang body the worker runs, and the
worker's outputs back into the endpoint's answer: SSE events or one JSON
body. Shared by the HTTP server and the Dynamo backend, as hypercorn's
sans-I/O protocol layer is by its trio and asyncio workers. A plan refuses a
body with ``InvalidRequest`` (``param`` in the client's words); which status
that becomes is for the edge that answers.
"""

from ._native import NativePlan
from ._openai import ChatPlan, CompletionPlan, OpenAIPlan
from ._plan import Plan
from ._sse import sse_data, sse_event

__all__ = [
    "ChatPlan",
    "CompletionPlan",
    "NativePlan",
    "OpenAIPlan",
    "Plan",
    "sse_data",
    "sse_event",
]
