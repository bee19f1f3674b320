"""The HTTP edge, who and what it admits: hosts, content types, bootstrap addresses, keys and
counts, and faults below the routes (``test_edge.py``'s server and findings, 8 to 12).

8. ``--allowed-hosts`` and the JSON Content-Type are enforced;
9. a decode server connects to no client-supplied bootstrap address but those
   of ``--allowed-bootstrap-hosts``;
10. ``--api-key``, ``--max-running-requests`` and the context length bound
    requests; the soft RLIMIT_NOFILE is raised to the hard limit at start;
11. a protocol fault inside hypercorn (an h2c upgrade with a bad
    ``HTTP2-Settings``) is one log line, and no request header reaches the log;
12. HTTP/2 clients that grant no flow-control window hold no slot, a stream its client takes
    nothing of is stopped, and an h2c upgrade is answered in HTTP/1.1 unless ``--http2`` is on.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

import test_edge
from _edge_server import (
    HEALTH_TIMEOUT,
    LONG,
    MODEL,
    TIMEOUT,
    Server,
    closed_within,
    connect,
    read_head,
    request_bytes,
)
from _hostile_clients import h2_requests
from _processes import wait_until

#: test_edge.py's fixtures: a server for one test, and one on the defaults for this module.
start = test_edge.start
server = test_edge.server

# -- 8. Host and Content-Type ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("text/plain", 415),
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
    ],
)
def test_only_json_bodies_are_taken(server: Server, content_type: str, status: int) -> None:
    body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    response = server.request(
        "POST", "/generate", content=body, headers={"content-type": content_type}
    )
    assert response.status_code == status, response.text[:500]
    server.wait_idle()


def test_a_host_not_allowed_is_a_400(start: Callable[..., Server]) -> None:
    server = start("--allowed-hosts", "localhost")
    port = server.address[1]
    server.headers["host"] = f"localhost:{port}"
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    registered = server.engine_events("registered")
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port}"):
        response = server.post("/generate", body, headers={"host": host})
        assert response.status_code == 400, (host, response.text[:500])
    assert server.engine_events("registered") == registered
    assert server.post("/generate", body).status_code == 200  # localhost:<port>
    server.assert_clean_exit()


# -- 9. a decode server's bootstrap addresses ---------------------------------------------


@pytest.mark.parametrize("allowed", [False, True], ids=["not-allowed", "allowed"])
def test_a_decode_server_connects_only_to_allowed_bootstrap_hosts(
    start: Callable[..., Server], allowed: bool
) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        flags = ["--disaggregation-mode", "decode", "--sim-kv-wait-timeout", "3"]
        if allowed:
            flags += ["--allowed-bootstrap-hosts", f"127.0.0.1:{port}"]
        server = start(*flags)
        body = {
            "text": "hi",
            "sampling_params": {"max_new_tokens": 2},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port,
            "bootstrap_room": 12345,
        }
        with connect(server) as client:
            client.sendall(request_bytes(server, "/generate", body))
            accepted = bool(select.select([listener], [], [], 2 if allowed else 1)[0])
            if allowed:
                assert accepted, "the allowed bootstrap address was never reached"
            else:
                assert not accepted, "the server connected to a bootstrap host not allowed"
                head = read_head(client)
                assert head.startswith(b"HTTP/1.1 400"), head[:300]
    server.wait_idle()
    server.assert_clean_exit()


# -- 10. API key, running requests, context length, fd limit --------------------------------

API_KEY = "edge-test-key-4f1c"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_api_key_guards_every_route_but_health(
    start: Callable[..., Server], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "env":
        monkeypatch.setenv("TRIO_SGLANG_API_KEY", API_KEY)
        server = start()
    else:
        server = start("--api-key", API_KEY)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
        assert server.post("/generate", body, headers=headers).status_code == 401, headers
        assert server.request("GET", "/metrics", headers=headers).status_code == 401, headers
    assert server.request("GET", "/health").status_code == 200
    server.headers["authorization"] = f"Bearer {API_KEY}"
    assert server.post("/generate", body).status_code == 200
    assert API_KEY not in server.output()
    server.assert_clean_exit()


@pytest.mark.slow
def test_requests_past_max_running_requests_get_a_503(start: Callable[..., Server]) -> None:
    server = start("--max-running-requests", "2", "--sim-token-interval", "0.05")
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 1000}}
    with contextlib.ExitStack() as closing:
        for _ in range(2):
            sock = closing.enter_context(connect(server))
            sock.sendall(request_bytes(server, "/generate", body))
            assert read_head(sock).startswith(b"HTTP/1.1 200")
        short = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        response = server.post("/generate", short)
        assert response.status_code == 503, response.text[:500]
        assert "retry-after" in response.headers
        assert server.live() == 2
    server.wait_idle()
    assert server.post("/generate", short).status_code == 200  # the slots came back
    server.assert_clean_exit()


ABSURD = 2**31 - 1
CHAT_MESSAGES = [{"role": "user", "content": "hi"}]
COMPLETIONS = {"model": MODEL, "prompt": "hi"}


@pytest.mark.parametrize(
    ("flags", "path", "body", "param"),
    [
        pytest.param(
            (), "/v1/completions", {**COMPLETIONS, "max_tokens": ABSURD}, "max_tokens",
            id="completions-2**31-1",
        ),
        pytest.param(
            (), "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": ABSURD}, "max_tokens",
            id="chat-2**31-1",
        ),
        pytest.param(
            (), "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": ABSURD}},
            "max_new_tokens",
            id="generate-2**31-1",
        ),
        pytest.param(
            ("--context-length", "64"), "/v1/completions", {**COMPLETIONS, "max_tokens": 100},
            "max_tokens",
            id="context-length-64",
        ),
    ],
)  # fmt: skip
def test_max_tokens_past_the_context_length_is_a_400(
    start: Callable[..., Server],
    flags: tuple[str, ...],
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    server = start(*flags)
    registered = server.engine_events("registered")
    response = server.post(path, body)
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == param, error
    assert server.engine_events("registered") == registered
    server.assert_clean_exit()


# -- 11. protocol faults inside hypercorn -------------------------------------------------


def test_a_bad_h2c_upgrade_is_one_log_line_without_headers(start: Callable[..., Server]) -> None:
    server = start("--http2")
    secret = "hunter2-header-value"
    before = len(server.output())
    with connect(server) as sock:
        sock.sendall(
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: A\r\n"
            + f"X-Secret: {secret}\r\nAuthorization: Bearer {secret}\r\n\r\n".encode()
        )
        assert closed_within(sock, 3)
    server.assert_healthy()
    server.assert_clean_exit()  # then the log is whole
    added = server.output()[before:].splitlines()
    loud = [line for line in added if not line.startswith(("INFO ", "DEBUG "))]
    assert len(loud) <= 1, "\n".join(added)
    assert secret not in server.output()


# -- 12. HTTP/2 clients that grant no window --------------------------------------


@pytest.mark.parametrize(
    ("flags", "streams"), [((), 100), (("--http2",), 10)], ids=["http11-only", "http2"]
)
def test_zero_window_http2_clients_hold_no_slot(
    start: Callable[..., Server], flags: tuple[str, ...], streams: int
) -> None:
    """Without this rule, 50 such connections took every slot of ``--max-connections 50``
    for good (and 21 of 100 streams each, every request slot): ``/health`` timed out.

    HTTP/2 off (the default), the preface is answered as the HTTP/1.1 request it
    reads as, and the connection closes at once. With ``--http2``, each 401 waits
    for a window that never opens: its stream is reset after the stall timeout,
    and the connection, left with none, is dropped. There each stream runs a
    handler to its 401 first: 10 a connection, since 6,000 take seconds of CPU
    on 2 cores, and the hold, not that cost, is what is tested.
    """
    server = start(
        "--api-key", "k", "--max-connections", "50", "--client-stall-timeout", "1", *flags
    )
    # Keyless GETs, whose answers (401s) can then never be sent.
    probe = h2_requests("x", streams, path="/v1/models", zero_window=True)
    held = []
    for _ in range(60):
        sock = connect(server)
        sock.sendall(probe)
        held.append(sock)  # open, never reading: as the probe left them
    try:
        for sock in held:
            assert closed_within(sock, 2.0), "an HTTP/2 zero-window client kept its connection"
        started = time.monotonic()
        server.headers = {"authorization": "Bearer k"}
        server.assert_healthy()
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        response = server.post("/generate", body)
        assert response.status_code == 200, response.text
        assert time.monotonic() - started < HEALTH_TIMEOUT + TIMEOUT
    finally:
        for sock in held:
            sock.close()
    server.assert_clean_exit()


def test_an_http2_stream_its_client_takes_nothing_of_is_stopped(
    start: Callable[..., Server],
) -> None:
    """With ``--http2``: a long streaming ``/generate`` on a window of 0. Without this
    rule it generated on for nobody, its handler and slot held for good; now the stream is
    reset once 32 KiB wait for the client and the stall timeout passed, its request
    stopped at the engine, the connection (left with no stream) dropped, and counted
    as a stalled client."""
    server = start("--http2", "--client-stall-timeout", "1", "--sim-token-interval", "0.001")
    body = json.dumps(
        {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": LONG}}
    ).encode()
    with connect(server) as sock:
        sock.sendall(h2_requests("x", 1, body, zero_window=True))
        wait_until("the request to reach the engine", lambda: server.live() == 1, 5, server.process)
        started = time.monotonic()
        assert closed_within(sock, 3), "a stream its client took nothing of kept its connection"
        assert time.monotonic() - started < 1 + 1.5
    server.wait_idle(2)
    assert server.metric("trio_sglang_clients_dropped_total", reason="stalled") == 1
    server.assert_clean_exit()


@pytest.mark.parametrize(("flags", "status"), [((), 200), (("--http2",), 101)])
def test_h2c_upgrades_are_answered_in_http11_unless_http2_is_on(
    start: Callable[..., Server], flags: tuple[str, ...], status: int
) -> None:
    server = start(*flags)
    with connect(server) as sock:
        sock.sendall(
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
        )
        head = read_head(sock)
    assert head.startswith(b"HTTP/1.1 %d " % status), head
    server.assert_clean_exit()
