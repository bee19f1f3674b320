"""Client-facing HTTP errors, in OpenAI's error shape.

OpenAI's body is ``{"error": {"message", "type", "param", "code"}}``: ``type``
is the error's class (``invalid_request_error``, ``server_error``), ``code`` a
machine-readable string a client can branch on (``invalid_api_key``,
``context_length_exceeded``) or null, never the HTTP status: the openai SDK
reads ``code`` as a string. The status is the response's own. (SGLang's own
``ErrorResponse`` puts the status in ``code``; OpenAI's clients are the ones
that parse these bodies, so the server speaks OpenAI's shape.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["HTTPError", "error_body", "method_not_allowed"]


class HTTPError(Exception):
    """Raised while handling a request; turned into a JSON error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        #: Response headers beside the JSON ones (``WWW-Authenticate``, ``Retry-After``, ``Allow``).
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, kind=self.kind, code=self.code, param=self.param)


def error_body(
    message: str,
    *,
    kind: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def method_not_allowed(method: str, path: str, allowed: Sequence[str]) -> HTTPError:
    """405, with the ``Allow`` header that HTTP requires of it (RFC 9110, 15.5.6)."""
    return HTTPError(
        405,
        f"{method} is not allowed on {path}; it takes {', '.join(allowed)}",
        headers=[(b"allow", ", ".join(allowed).encode())],
    )
