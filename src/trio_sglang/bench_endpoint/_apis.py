"""The three request dialects bench-endpoint speaks, their routes, and a streaming request in each.

Apart from the client (``_clients``), which needs httpx, so that the
command's options can list them without the bench extra. The load test's
clients (``benchmarks/_load_clients.py``, ``_load_hostile.py``) and the
serving benchmark's lean one (``benchmarks/_sse_client.py``) build their
requests here too: every benchmark asks in the same words.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["API_PATHS", "Api", "request_body"]

Api = Literal["openai-chat", "openai-completions", "sglang-generate"]
API_PATHS: dict[Api, str] = {
    "openai-chat": "/v1/chat/completions",
    "openai-completions": "/v1/completions",
    "sglang-generate": "/generate",
}


def request_body(
    path: str, prompt: str, max_tokens: int, *, model: str | None = None, ignore_eos: bool = False
) -> dict[str, Any]:
    """A streaming request for ``path`` in its dialect: SGLang's ``/generate`` (which takes no
    model), OpenAI's completions, or else OpenAI's chat. ``model`` and ``ignore_eos`` go in
    only when given, so that a server that knows neither is not asked for them."""
    if path == "/generate":
        params: dict[str, Any] = {"max_new_tokens": max_tokens}
        if ignore_eos:
            params["ignore_eos"] = True
        return {"text": prompt, "stream": True, "sampling_params": params}
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": True}
    if ignore_eos:
        body["ignore_eos"] = True
    if model is not None:
        body["model"] = model
    if path == "/v1/completions":
        return {**body, "prompt": prompt}
    return {**body, "messages": [{"role": "user", "content": prompt}]}
