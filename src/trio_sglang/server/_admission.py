"""``Admission``: whether a request may reach the engine, decided before it does.

What an engine takes in is what a client can make it hold, so the bounds of
``ServerLimits`` are checked at the HTTP edge, each as early as what it needs
allows, and a refused request never reaches the worker:

- ``check_access``, every route, from the headers alone: the framing (not
  both Content-Length and Transfer-Encoding), the Host header against
  ``allowed_hosts`` (a page in a browser that reaches a local server
  through a name of its own, DNS rebinding, is refused), then the API key;
- ``check_content_type``, the generation routes, before the body is read:
  only JSON bodies (a browser sends a form or plain text to any address
  without asking first; JSON it must ask for);
- ``check_request``, after the endpoint's parse, before the worker's: the
  children one request asks for, its ``rid``, its tokens against the context
  length, and on a decode server the bootstrap address it names, which the
  decode engine would connect to (a request must not make the server reach
  anywhere else: server-side request forgery);
- ``check_load``, last: the engine requests in flight, each completion of a
  request counting as one, as SGLang's scheduler counts them.

Each refusal is a ``Refused`` (an ``HTTPError``) and is counted once, as it is
raised, in ``trio_sglang_requests_refused_total{reason}``.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

from .._core._disagg import PrefillPeer
from .._limits import Address, ServerLimits, parse_address
from ._asgi import Scope
from ._http_errors import HTTPError
from ._kv_rooms_http import bootstrap_base_url
from ._metrics import RefusalReason, ServerMetrics

__all__ = ["Admission", "Refused"]


#: OpenAI's error codes, where OpenAI has one for the refusal; any other refusal's
#: code is its reason, the label it is counted under.
_OPENAI_CODES: dict[RefusalReason, str] = {
    "unauthorized": "invalid_api_key",
    "context_length": "context_length_exceeded",
}


class Refused(HTTPError):
    """A request that admission refused, and why (its ``trio_sglang_requests_refused`` reason).

    The reason is also the error body's ``code``, or OpenAI's code for it.
    """

    def __init__(self, reason: RefusalReason, status: int, message: str, **details: Any) -> None:
        super().__init__(status, message, code=_OPENAI_CODES.get(reason, reason), **details)
        self.reason = reason


class Admission:
    """The checks of one server; ``context_length`` and the decode role are its engine's."""

    def __init__(
        self,
        limits: ServerLimits,
        metrics: ServerMetrics,
        *,
        context_length: int | None,
        decode: bool,
        prefill: PrefillPeer | None = None,
        no_transfer_host: str | None = None,
    ) -> None:
        self.limits = limits
        self.metrics = metrics
        self.context_length = (
            context_length if limits.context_length is None else limits.context_length
        )
        self._key = None if limits.api_key is None else limits.api_key.encode()
        self._hosts = [_entry(host) for host in limits.allowed_hosts]
        # Only a decode engine connects to the bootstrap address a request names.
        self._bootstrap: list[Address] | None = None
        if decode:
            self._bootstrap = [_entry(host) for host in limits.allowed_bootstrap_hosts]
            if prefill is not None:
                self._bootstrap.append((_bare(prefill.bootstrap_host), prefill.bootstrap_port))
        #: Names no prefill server: the engine fakes the KV cache (``HostedApp.no_transfer_host``).
        self._no_transfer_host = no_transfer_host

    def _refuse(self, reason: RefusalReason, status: int, message: str, **details: Any) -> Refused:
        self.metrics.refused(reason)
        return Refused(reason, status, message, **details)

    def check_access(self, scope: Scope, *, needs_key: bool) -> None:
        """The framing, the Host header, then (if ``needs_key``) ``Authorization: Bearer``.

        A request with both Content-Length and Transfer-Encoding is refused, and
        its connection closed (RFC 9112, 6.3): a proxy that framed it by the
        length would send what follows the chunked body as a request of its own.
        """
        if _headers(scope, b"content-length") and _headers(scope, b"transfer-encoding"):
            raise self._refuse(
                "bad_framing",
                400,
                "a request must not carry both Content-Length and Transfer-Encoding",
            )
        if self._hosts and not _all(
            _headers(scope, b"host"), lambda value: _allowed(self._hosts, parse_address(value))
        ):
            raise self._refuse(
                "host_not_allowed", 400, "the Host header names no host this server answers to"
            )
        if needs_key and self._key is not None:
            key = self._key
            if not _all(_headers(scope, b"authorization"), lambda value: _bearer(value, key)):
                raise self._refuse(
                    "unauthorized",
                    401,
                    "Incorrect API key provided: send it as `Authorization: Bearer <key>`.",
                    headers=[(b"www-authenticate", b"Bearer")],
                )

    def check_content_type(self, scope: Scope) -> None:
        """``application/json`` in any letter case, with parameters (``; charset=utf-8``) or not."""
        if not _all(
            _headers(scope, b"content-type"),
            lambda value: value.split(b";")[0].strip().lower() == b"application/json",
        ):
            raise self._refuse(
                "unsupported_media_type",
                415,
                "the request body must be JSON, sent with `Content-Type: application/json`",
            )

    def check_request(
        self, endpoint: str, body: Mapping[str, Any], native: Mapping[str, Any]
    ) -> int:
        """Children, ``rid``, context length and bootstrap address of a parsed request.

        ``native`` is the SGLang body the endpoint made of ``body``; it is read
        as the worker will read it, but cheaply (nothing here walks a prompt's
        token ids), and a value of the wrong type is left to the worker to refuse.
        Returns the completions it asks for (prompts times ``n``), for ``check_load``.
        """
        generate = endpoint == "/generate"
        prompts = _prompt_count(native)
        params = native.get("sampling_params")
        # The worker takes one n for every prompt, so the first one's is the request's.
        first = (params[0] if params else None) if isinstance(params, list) else params
        n = first.get("n") if isinstance(first, Mapping) else None
        n = n if _is_int(n) and n > 1 else 1
        limit = self.limits.max_children_per_request
        if prompts * n > limit:
            raise self._refuse(
                "too_many_children",
                400,
                f"this request asks for {prompts} prompt(s) times n = {n}, "
                f"{prompts * n} completions; the most one request may ask for is {limit}",
                param="n",
            )
        self._check_rid(native.get("rid"))
        if self.context_length is not None:
            name = "max_new_tokens" if generate else "max_tokens"
            if body.get("max_completion_tokens") is not None:
                name = "max_completion_tokens"
            # Both as long as the prompts (at most the children limit), or the worker refuses.
            per_prompt = params if isinstance(params, list) else [params] * prompts
            for length, one in zip(_id_lengths(native, prompts), per_prompt, strict=False):
                budget = one.get("max_new_tokens") if isinstance(one, Mapping) else None
                self._check_context(length, budget, name, "input_ids" if generate else "prompt")
        if self._bootstrap is not None and native.get("bootstrap_host") is not None:
            self._check_bootstrap(native.get("bootstrap_host"), native.get("bootstrap_port"))
        return prompts * n

    def _check_rid(self, rid: object) -> None:
        limit = self.limits.max_rid_length
        rids = rid if isinstance(rid, list) else [rid]
        if any(isinstance(one, str) and len(one) > limit for one in rids):
            raise self._refuse(
                "rid_too_long", 400, f"'rid' is over {limit} characters", param="rid"
            )
        # A rid names the request in responses and in the logs: no line breaks, no
        # terminal escapes that a log reader would take for the server's own lines.
        if any(isinstance(one, str) and not one.isprintable() for one in rids):
            raise self._refuse(
                "rid_too_long", 400, "'rid' must be printable characters only", param="rid"
            )

    def _check_context(self, length: int, budget: object, name: str, prompt_name: str) -> None:
        """SGLang's check (``TokenizerManager._validate_one_request``), in its words.

        A text prompt is not tokenized here: its length counts as 0, so only
        what SGLang would refuse whatever the text is refused.
        """
        limit = self.context_length
        assert limit is not None
        if length >= limit:
            raise self._refuse(
                "context_length",
                400,
                f"The input ({length} tokens) is longer than the model's context length "
                f"({limit} tokens).",
                param=prompt_name,
            )
        if _is_int(budget) and budget >= 0 and length + budget >= limit:
            asked = f"{budget} tokens for the completion alone"
            if length:
                asked = (
                    f"a total of {length + budget} tokens: {length} tokens from the input "
                    f"messages and {budget} tokens for the completion"
                )
            raise self._refuse(
                "context_length",
                400,
                f"Requested token count exceeds the model's maximum context length of {limit} "
                f"tokens. You requested {asked}. Please reduce the number of tokens in the "
                "input messages or the completion to fit within the limit.",
                param=name,
            )

    def _check_bootstrap(self, hosts: object, ports: object) -> None:
        """Each address the decode engine would connect to, before it does.

        One value, or one per prompt of a native batch (the worker checks
        the lengths); pairs that a batch cannot make are checked too, which
        is never less strict.
        """
        assert self._bootstrap is not None
        host_list = hosts if isinstance(hosts, list) else [hosts]
        port_list = ports if isinstance(ports, list) else [ports]
        pairs = (
            zip(host_list, port_list, strict=True)
            if len(host_list) == len(port_list)
            else ((host, port) for host in host_list for port in port_list)
        )
        for host, port in pairs:
            if host is not None and host == self._no_transfer_host:
                continue  # no connection is made
            if not (isinstance(host, str) and (port is None or _is_int(port))):
                allowed = False
            # As the decode engine will build its URL: a bracketed or otherwise
            # malformed host would name no address, or another than the one allowed.
            elif bootstrap_base_url(host, 0 if port is None else port) is None:
                raise self._refuse(
                    "bootstrap_not_allowed",
                    400,
                    f"bootstrap_host {host!r:.100} is not a host name or an IP address "
                    "(written bare, an IPv6 address without brackets)",
                    param="bootstrap_host",
                )
            else:
                allowed = _allowed(self._bootstrap, (host.lower(), port))
            if not allowed:
                raise self._refuse(
                    "bootstrap_not_allowed",
                    400,
                    f"bootstrap_host {host!r:.100} with bootstrap_port {port!r:.20} is not a "
                    "prefill server this decode server may reach",
                    param="bootstrap_host",
                )

    def check_load(self, running: int, children: int) -> None:
        """``running``: the engine requests in flight; ``children``: this request's.

        Each completion is an engine request (SGLang's scheduler runs every one
        of a request's ``n`` apart), and each costs the server a stream to
        read and events to send: 20 requests of ``n`` = 256 once made the
        server too busy to answer ``/health``, however few they were.
        """
        limit = self.limits.max_running_requests
        if running + children > limit:
            raise self._refuse(
                "overloaded",
                503,
                f"the server is at its limit of {limit} engine requests in flight "
                f"({running} running, {children} asked for); try again shortly",
                kind="server_error",
                headers=[(b"retry-after", b"1")],
            )


def _headers(scope: Scope, name: bytes) -> list[bytes]:
    """Every value of one header (ASGI names are lower-case; hypercorn puts HTTP/2's
    ``:authority`` in ``host``)."""
    return [value for key, value in scope.get("headers", ()) if key == name]


def _all(values: Sequence[bytes], check: Callable[[bytes], bool]) -> bool:
    """At least one value, and each passes: a repeated header cannot slip one by."""
    return bool(values) and all(check(value) for value in values)


def _bearer(value: bytes, key: bytes) -> bool:
    scheme, _, token = value.partition(b" ")
    # compare_digest: how long the comparison takes tells nothing about the key.
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_count(native: Mapping[str, Any]) -> int:
    """Prompts, as the worker counts them: a list of texts, or of token-id lists, is a batch."""
    text, ids = native.get("text"), native.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return 1


def _id_lengths(native: Mapping[str, Any], prompts: int) -> list[int]:
    """Each prompt's length in tokens when given as ids; 0 for text."""
    ids = native.get("input_ids")
    if not (isinstance(ids, list) and ids):
        return [0] * prompts
    if isinstance(ids[0], list):
        return [len(one) if isinstance(one, list) else 0 for one in ids]
    return [len(ids)]


def _bare(host: str) -> str:
    """A host as compared: lower-case, an IPv6 literal without its brackets."""
    return host.lower().removeprefix("[").removesuffix("]")


def _entry(text: str) -> Address:
    address = parse_address(text)
    assert address is not None  # ``ServerLimits`` checks its entries
    return address


def _allowed(entries: Sequence[Address], address: Address | None) -> bool:
    """Whether an entry names ``address``: the same host, and its port or any port."""
    return address is not None and any(
        host == address[0] and port in (None, address[1]) for host, port in entries
    )
