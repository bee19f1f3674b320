"""``ServerLimits``: every resource a client can make the server hold, and its bound.

One frozen record, so that the CLI, ``serve`` and the tests agree on the
defaults, and ``trio-sglang serve --help`` shows each of them. The defaults
suit a server on a trusted network in front of one engine; docs/serving.md
says what each one costs and when to change it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ._request._values import check_at_least

__all__ = ["API_KEY_ENV", "Address", "ServerLimits", "parse_address"]

#: ``(host, port)``, the host lower-case and without brackets; no port: any port.
Address = tuple[str, int | None]

#: Where ``trio-sglang serve`` reads the API key when ``--api-key`` is not given
#: (a key on the command line is visible to every user of the machine).
API_KEY_ENV = "TRIO_SGLANG_API_KEY"


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Bounds on connections, requests and clients; durations in seconds."""

    # -- connections --------------------------------------------------------
    #: Connections held at once. Past it the server stops accepting (new
    #: clients wait in the kernel's accept queue). ``trio-sglang serve`` lowers
    #: it at start to fit the file-descriptor limit, whose soft value it first
    #: raises to the hard one.
    max_connections: int = 4096
    #: An idle keep-alive connection, or one whose request headers have not
    #: all arrived, is closed after this long.
    keep_alive_timeout: float = 5.0
    #: A request's body must arrive within this long of its headers; a slower
    #: one gets 408 and its connection is closed.
    request_read_timeout: float = 30.0
    #: A client that takes none of a write (at most 64 KiB) for this long is
    #: gone: its request is stopped at the engine and its connection is reset.
    client_stall_timeout: float = 10.0
    #: Tokens a streaming response may hold produced but not yet sent (they are
    #: coalesced into fewer, larger events while the client is behind). A
    #: client further behind than this is gone, as a stalled one is.
    max_unsent_tokens: int = 4096
    #: A streaming response with nothing to send for this long sends an SSE
    #: comment (about 15 bytes), which clients ignore: a proxy that notices a
    #: gone client only when it writes (sglang-router) then notices within
    #: this. 0: never.
    sse_heartbeat: float = 0.1
    #: SSE heartbeats a second, all streams together. Past this many silent streams
    #: per ``sse_heartbeat`` each beats less often (every streams / this
    #: seconds), so that thousands of them cost a bounded share of a core; a
    #: proxy then notices a gone client within that longer spacing.
    max_sse_heartbeats_per_second: int = 1000
    #: Whether a client may speak HTTP/2 (cleartext: prior knowledge, or an h2c
    #: upgrade). There the stall bound holds per stream: a stream whose client
    #: grants it no flow-control window for ``client_stall_timeout`` (32 KiB
    #: waiting, or its end) is reset and its request stopped, and a connection
    #: left with no stream is dropped. Off by default, as SGLang's own server
    #: speaks HTTP/1.1 only: an h2c upgrade is then answered in HTTP/1.1, and
    #: the HTTP/2 preface gets an HTTP/1.1 error.
    http2: bool = False

    # -- admission ----------------------------------------------------------
    #: Largest request body taken; a larger one gets 413.
    max_body_bytes: int = 1 << 20
    #: Engine requests in flight at once, as SGLang's scheduler counts them:
    #: each completion a request asks for (prompts times ``n``) is one. A
    #: request that would go past it gets 503 with Retry-After.
    max_running_requests: int = 2048
    #: Prompts times ``n`` in one request.
    max_children_per_request: int = 256
    #: Characters in a caller's ``rid``, as ``/generate`` takes it (each entry
    #: of a list of them).
    max_rid_length: int = 256
    #: Prompt plus ``max_tokens``, in tokens (default: the engine's).
    context_length: int | None = None

    # -- access -------------------------------------------------------------
    #: When set, every route but ``/health`` needs ``Authorization: Bearer <key>``.
    api_key: str | None = None
    #: The Host headers accepted, as host or host:port (default: any); against
    #: DNS rebinding when the server is reachable from a browser.
    allowed_hosts: tuple[str, ...] = ()
    #: A decode server's prefill bootstrap addresses (host or host:port) that a
    #: request's ``bootstrap_host``/``bootstrap_port`` may name, beside the
    #: ``--prefill-url`` server's (default: none); any other is refused before
    #: a connection.
    allowed_bootstrap_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in fields(self):
            name, value = field.name, getattr(self, field.name)
            if name.endswith("_timeout"):  # 0 would refuse every client at once
                check_at_least(name, value, 0, above=True)
            elif name == "sse_heartbeat":  # 0: off
                check_at_least(name, value, 0)
            elif name.startswith("max_") or (name == "context_length" and value is not None):
                check_at_least(name, value, 1, integer=True)
            elif name == "http2" and not isinstance(value, bool):
                raise ValueError(f"http2 must be a bool, got {value!r}")
            elif name == "api_key" and value == "":
                raise ValueError("api_key must not be empty (None: no key)")
            elif name.endswith("_hosts"):
                for entry in value:
                    if parse_address(entry) is None:
                        raise ValueError(f"{name}: {entry!r} is not a host or host:port")


def parse_address(value: bytes | str) -> Address | None:
    """``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or a bare IPv6 literal; else ``None``."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    host, port = text, ""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or not (rest == "" or rest.startswith(":")):
            return None
        port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host or not (port == "" or (port.isascii() and port.isdigit() and len(port) <= 5)):
        return None
    return host.lower(), int(port) if port else None
