"""The three request dialects bench-endpoint speaks, and their routes.

Apart from the client (``_clients``), which needs httpx, so that the
command's options can list them without the bench extra.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["API_PATHS", "Api"]

Api = Literal["openai-chat", "openai-completions", "sglang-generate"]
API_PATHS: dict[Api, str] = {
    "openai-chat": "/v1/chat/completions",
    "openai-completions": "/v1/completions",
    "sglang-generate": "/generate",
}
