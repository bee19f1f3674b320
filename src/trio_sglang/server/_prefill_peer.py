"""``HTTPPrefill``: a prefill ``trio-sglang serve`` as a decode worker's ``PrefillPeer``."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import httpx

from .._bounded_http import Answer, BadAnswer, read_answer
from .._core._disagg import PrefillFailed
from .._core._outputs import finish_reason_type

__all__ = ["HTTPPrefill"]

_DEFAULT_PORTS = {"http": 80, "https": 443}
#: The most a prefill server's ``/capabilities`` may answer (ours is about 2 kB).
MAX_CAPABILITIES_BYTES = 1 << 20


class HTTPPrefill:
    """A prefill server over HTTP; an async context manager that owns its connections.

    Each prefill leg is one non-streaming ``POST /generate`` carrying the
    leg's bootstrap fields, with the request's public id as its ``rid`` (so
    both servers' logs name it alike). Cancelling ``prefill`` closes that
    connection, which a prefill ``serve`` turns into a cancel at once (a
    disconnect kills the request), in whichever queue the leg is: what its
    ``disagg_prefill_cancel_anytime_v1`` promises.

    ``bootstrap_port`` is where decode engines reach the prefill side's KV
    rooms: a prefill ``serve`` on the SimEngine hosts them on its HTTP port
    (the default); on SGLang (``--engine sglang``) it is SGLang's bootstrap
    server, ``--disaggregation-bootstrap-port`` (8998 unless set).
    ``prefill_timeout`` bounds one leg from request to answer (a leg can
    queue behind others: SGLang's own bootstrap and KV waits default to
    300 s); ``timeout`` bounds connecting, and the whole of ``capabilities``.
    ``api_key``: the prefill server's ``--api-key``, sent as a bearer token.
    ``max_answer_bytes`` bounds a leg's answer (a prefill leg decodes one
    token, but asks for the request's logprobs too, which grow with the
    prompt: 32 MiB by default); an answer past it, or one not JSON, fails the
    leg (``PrefillFailed``), as does one that does not arrive in full within
    ``prefill_timeout``.
    """

    def __init__(
        self,
        url: str,
        *,
        bootstrap_port: int | None = None,
        prefill_timeout: float = 300.0,
        timeout: float = 5.0,
        api_key: str | None = None,
        max_answer_bytes: int = 32 << 20,
    ) -> None:
        base = httpx.URL(url)
        if base.scheme not in _DEFAULT_PORTS or not base.host:
            raise ValueError(f"the prefill server's URL must be http(s)://host[:port], got {url!r}")
        self.name = url
        self.bootstrap_host = base.host
        self.bootstrap_port = bootstrap_port or base.port or _DEFAULT_PORTS[base.scheme]
        self._prefill_timeout = prefill_timeout
        self._timeout = timeout
        self._max_answer_bytes = max_answer_bytes
        # Internal traffic: no proxy from the environment. A leg holds its
        # connection for as long as it runs, so the pool is not capped (the
        # decode server's own clients bound how many legs there are).
        self._client = httpx.AsyncClient(
            base_url=base,
            timeout=httpx.Timeout(timeout, read=None),
            limits=httpx.Limits(max_connections=None),
            trust_env=False,
            headers={} if api_key is None else {"authorization": f"Bearer {api_key}"},
        )

    async def __aenter__(self) -> HTTPPrefill:
        await self._client.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._client.__aexit__(exc_type, exc, tb)

    async def capabilities(self) -> Mapping[str, Any]:
        """``GET /capabilities``; ``PrefillFailed`` unless it is a prefill worker's."""
        try:
            answer = await read_answer(
                self._client,
                "GET",
                "/capabilities",
                max_bytes=MAX_CAPABILITIES_BYTES,
                within=self._timeout,
            )
        except BadAnswer as exc:
            raise PrefillFailed(f"could not read {exc}") from exc
        if not answer.ok:
            raise PrefillFailed(f"{self.name}/capabilities answered {answer.status}: {answer.head}")
        capabilities = answer.json()
        role = capabilities.get("role") if isinstance(capabilities, dict) else None
        if not isinstance(capabilities, dict) or role != "prefill":
            raise PrefillFailed(f"{self.name} is not a prefill worker (role: {role!r:.100})")
        return capabilities

    async def prefill(self, request: Mapping[str, Any], public_id: str) -> None:
        """Run one leg; ``PrefillFailed`` on an error answer, an abort, or no answer in time."""
        body = {**request, "rid": public_id, "stream": False}
        try:
            answer = await read_answer(
                self._client,
                "POST",
                "/generate",
                json=body,
                max_bytes=self._max_answer_bytes,
                within=self._prefill_timeout,
            )
        except BadAnswer as exc:
            raise PrefillFailed(str(exc)) from exc
        reason = _finish_reason(answer, self.name)
        if finish_reason_type(reason) != "length":
            raise PrefillFailed(f"{self.name} ended the prefill with {reason!r:.200}")


def _finish_reason(answer: Answer, name: str) -> object:
    """The ``finish_reason`` of a ``/generate`` answer; ``PrefillFailed`` for an error answer."""
    payload = answer.json()
    if not answer.ok:
        error = payload.get("error") if isinstance(payload, dict) else None
        message = error.get("message") if isinstance(error, dict) else answer.head
        raise PrefillFailed(f"{name} answered {answer.status}: {str(message)[:200]}")
    meta = payload.get("meta_info") if isinstance(payload, dict) else None
    if not isinstance(meta, dict):
        raise PrefillFailed(f"{name} did not answer as SGLang's /generate: {answer.head!r}")
    return meta.get("finish_reason")
