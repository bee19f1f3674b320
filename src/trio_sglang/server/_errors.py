"""Client-facing HTTP errors, with OpenAI's error body shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["HTTPError", "error_body"]


class HTTPError(Exception):
    """Raised while handling a request; turned into a JSON error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        #: Response headers beside the JSON ones (``WWW-Authenticate``, ``Retry-After``).
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, kind=self.kind, param=self.param, code=self.status)


def error_body(
    message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: int
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
