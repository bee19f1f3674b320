"""Hostile clients leave nothing held: connections, slots, descriptors, engine requests.

Each test runs ``trio-sglang serve`` as a process on loopback (the SimEngine)
and is the client an attack on it was: frames that ask for nothing, bytes
pipelined behind a request, a burst of HTTP/2 streams then a reset, many
requests of many children, strings that are not Unicode. After each, the
server answers ``/health`` at once, holds no request, and exits cleanly on
SIGTERM. Each test failed before its rule held, its docstring says how, but the
three controls: a flood on a server without HTTP/2, a well-behaved HTTP/2
client, and pipelining as HTTP/1.1 allows it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import pytest

from _edge_server import (
    IDLE_TIMEOUT,
    LONG,
    Server,
    closed_within,
    connect,
    read_head,
    request_bytes,
    servers,
)
from _hostile_clients import flood_preface, h2_client, h2_frame, h2_requests, reset
from _processes import wait_until


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    with servers(tmp_path) as starting:
        yield starting


def _leave(sock: socket.socket, how: str) -> None:
    if how == "reset":
        reset(sock)
    else:
        sock.close()


def _flood(kind: str) -> bytes:
    """The client's preface, then about 70 KB of frames of ``kind`` that ask for nothing:
    ``priority`` is the load test's flooder."""
    if kind == "priority":
        return flood_preface()
    conn = h2_client()
    out = bytearray(conn.data_to_send())
    if kind == "ping":
        for _ in range(4000):
            out += h2_frame(6, 0, b"12345678")
    elif kind == "settings":
        for _ in range(8000):
            out += h2_frame(4, 0, b"")
    else:  # empty DATA frames on a request whose body never ends
        head = [(":method", "POST"), (":path", "/generate"), (":scheme", "http")]
        conn.send_headers(1, [*head, (":authority", "x"), ("content-type", "application/json")])
        out += conn.data_to_send()
        for _ in range(8000):
            out += h2_frame(0, 1, b"")
    return bytes(out)


def _goaway(sock: socket.socket, timeout: float) -> int | None:
    """The error code of the GOAWAY the server sent before it closed (``None``: none came)."""
    client = h2_client()
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            data = sock.recv(1 << 16)
            if not data:
                return None
            try:
                events = client.receive_data(data)
            except h2.exceptions.ProtocolError:
                return None
            for event in events:
                if isinstance(event, h2.events.ConnectionTerminated):
                    return int(event.error_code)
    except OSError:
        return None
    return None


# -- 1. frames that ask for nothing ---------------------------------------------------


@pytest.mark.parametrize("kind", ["priority", "ping", "settings", "empty-data"])
def test_a_flood_of_frames_that_ask_for_nothing_is_dropped_and_stalls_nothing(
    start: Callable[..., Server], kind: str
) -> None:
    """Without this rule 70 KB of PRIORITY frames once stalled ``/health`` for seconds (it
    timed out here), and floods of PING, SETTINGS or empty DATA held a core: now the
    client gets a GOAWAY (``ENHANCE_YOUR_CALM``) within its budget and is dropped."""
    server = start("--http2")
    with connect(server) as sock:
        sock.sendall(_flood(kind))
        server.assert_healthy()
        assert _goaway(sock, 3) == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        assert closed_within(sock, 3)
    assert server.metric("trio_sglang_clients_dropped_total", reason="flooding") == 1
    server.assert_clean_exit()


def test_frames_that_ask_for_nothing_reach_no_http2_parser_when_http2_is_off(
    start: Callable[..., Server],
) -> None:
    """The default server speaks HTTP/1.1 only: the preface is a bad request, closed at once."""
    server = start()
    with connect(server) as sock:
        sock.sendall(_flood("priority"))
        server.assert_healthy()
        assert closed_within(sock, 3)
    server.assert_clean_exit()


def test_a_clients_start_and_keep_alive_pings_are_within_the_budget(
    start: Callable[..., Server],
) -> None:
    """What a real client sends that asks for nothing is far inside the budget."""
    server = start("--http2")
    conn = h2_client()
    for i in range(20):
        conn.ping(b"%08d" % i)
        conn.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100 + i})
    head = [(":method", "GET"), (":path", "/health"), (":scheme", "http"), (":authority", "x")]
    conn.send_headers(1, head, end_stream=True)
    with connect(server) as sock:
        sock.sendall(conn.data_to_send())
        answered = False
        deadline = time.monotonic() + 3
        while not answered and time.monotonic() < deadline:
            data = sock.recv(1 << 16)
            assert data, "the server closed a well-behaved HTTP/2 client"
            for event in conn.receive_data(data):
                answered |= isinstance(event, h2.events.StreamEnded) and event.stream_id == 1
        assert answered
    assert server.metric("trio_sglang_clients_dropped_total", 0.0, reason="flooding") == 0
    server.assert_clean_exit()


# -- 2. and 3. a byte pipelined behind a request ------------------------------------------


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_byte_pipelined_behind_a_stream_holds_no_slot_once_its_client_left(
    start: Callable[..., Server], how: str
) -> None:
    """Without this rule each such client, gone, held its connection for good: 25 of them
    made a server of ``--max-connections 20`` unanswerable. Now each is let go at once."""
    server = start("--max-connections", "5", "--sim-token-interval", "0.01")
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": LONG}}
    descriptors = server.fds()
    for _ in range(8):
        sock = connect(server)
        sock.sendall(request_bytes(server, "/generate", body) + b"G")
        assert read_head(sock).startswith(b"HTTP/1.1 200")
        _leave(sock, how)
    server.wait_idle()
    server.assert_healthy()
    wait_until("the descriptors back", lambda: server.fds() <= descriptors, 5, server.process)
    server.assert_clean_exit()


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_byte_pipelined_behind_a_whole_response_does_not_hide_its_clients_leaving(
    start: Callable[..., Server], how: str
) -> None:
    """Without this rule such a request ran to its last token for nobody (30,000 here: ten
    minutes); now it stops as soon as its client has gone."""
    server = start("--sim-token-interval", "0.02")
    body = {"text": "hi", "sampling_params": {"max_new_tokens": LONG, "n": 4}}
    with connect(server) as sock:
        sock.sendall(request_bytes(server, "/generate", body) + b"G")
        wait_until("the request at the engine", lambda: server.live() == 4, 5, server.process)
        _leave(sock, how)
    server.wait_idle(IDLE_TIMEOUT)
    assert server.metric("trio_sglang_cancellations_total", 0.0) >= 1
    server.assert_clean_exit()


def test_pipelined_requests_are_answered_in_order(start: Callable[..., Server]) -> None:
    """Read on while a response is in progress, the next request still waits its turn."""
    server = start()
    host, port = server.address
    short = {"text": "hi", "sampling_params": {"max_new_tokens": 3}}
    health = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    with connect(server) as sock:
        sock.sendall(request_bytes(server, "/generate", short) + health)
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(1 << 16)
            assert chunk, data
            data += chunk
    first, second = data.split(b"HTTP/1.1 200")[1:3]
    assert b"meta_info" in first
    assert b'"ok"' not in first
    assert b"status" in second
    server.assert_clean_exit()


def test_a_client_pipelining_past_the_bound_is_dropped(start: Callable[..., Server]) -> None:
    """More than 64 KiB of a next request before the first one's response ends: the
    client is dropped, its request stopped, and counted as ``pipelined``."""
    server = start("--sim-token-interval", "0.01")
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": LONG}}
    with connect(server) as sock:
        sock.sendall(request_bytes(server, "/generate", body))
        assert read_head(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"G" * (70 << 10))
        assert closed_within(sock, 5)
    server.wait_idle()
    assert server.metric("trio_sglang_clients_dropped_total", reason="pipelined") == 1
    server.assert_clean_exit()


# -- 4. HTTP/2 streams opened while their connection closes -----------------------------


def test_http2_streams_opened_while_the_connection_closes_all_stop(
    start: Callable[..., Server],
) -> None:
    """A burst of 50 streaming requests in one write, then a reset, five times. Without
    this rule the streams that the server opened after the close began got no
    disconnect: 5 to 18 generated on 10 s later. Now every one stops."""
    server = start("--http2", "--sim-token-interval", "0.01")
    body = json.dumps(
        {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": LONG}}
    ).encode()
    for _ in range(5):
        sock = connect(server)
        sock.sendall(h2_requests("x", 50, body))
        time.sleep(0.02)
        reset(sock)
    server.wait_idle(IDLE_TIMEOUT)
    server.assert_clean_exit()


# -- 5. children in flight, in total ----------------------------------------------------

FAN_OUT = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": LONG, "n": 256}}


@contextlib.contextmanager
def fanned_out(server: Server, requests: int, *, answered: bool) -> Iterator[None]:
    """``requests`` streaming requests of ``n`` 256 whose clients read nothing (but the
    head of the answer, if ``answered``), their connections closed at the end."""
    with contextlib.ExitStack() as closing:
        for _ in range(requests):
            sock = closing.enter_context(connect(server))
            sock.sendall(request_bytes(server, "/generate", FAN_OUT))
            if answered:
                assert read_head(sock).startswith(b"HTTP/1.1 200")
        yield


def test_the_children_in_flight_are_bounded_in_total(start: Callable[..., Server]) -> None:
    """``--max-running-requests`` counts engine requests, each completion one, as SGLang's
    scheduler counts them. Without this rule it counted HTTP requests: 20 of ``n`` = 256
    made every ``/health`` time out, and SIGTERM did not end the process in 30 s."""
    server = start("--max-running-requests", "512", "--sim-token-interval", "0.01")
    with fanned_out(server, 2, answered=True):
        response = server.post("/generate", {**FAN_OUT, "stream": False})
        assert response.status_code == 503, response.text[:500]
        assert "512 engine requests" in response.json()["error"]["message"]
        one = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        assert server.post("/generate", one).status_code == 503  # not even one more
        server.assert_healthy()
        assert server.live() == 512
    server.wait_idle()
    server.assert_clean_exit()


@pytest.mark.slow
def test_many_children_at_the_default_bound_leave_the_server_responsive(
    start: Callable[..., Server],
) -> None:
    """2,048 children at 100 tokens a second each, their clients reading nothing:
    ``/health`` answers throughout, and SIGTERM ends it within the grace. Before issue
    37 the SimEngine's scheduler stepped every request it owed tokens to without a
    checkpoint, and such a load froze the process for good."""
    server = start("--sim-token-interval", "0.01")
    with fanned_out(server, 8, answered=False):
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            server.assert_healthy()
            time.sleep(0.5)
        server.assert_clean_exit(within=5)


# -- 6. strings that are not Unicode ----------------------------------------------------

LONE = "\ud800"


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/generate", "cache_salt", LONE),
        ("/generate", "routing_key", LONE),
        ("/generate", "session_id", LONE),
        ("/generate", "extra_key", LONE),
        ("/generate", "custom_labels", {"team": LONE}),
        ("/generate", "text", f"a {LONE} b"),
        ("/v1/chat/completions", "messages", [{"role": "user", "content": LONE}]),
        ("/v1/completions", "user", LONE),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400_that_reaches_nothing(
    start: Callable[..., Server], path: str, field: str, value: Any
) -> None:
    """Without this rule ``cache_salt`` got a 502 after the engine failed on it (a traceback
    per request, and on a decode server the request whole in an ERROR line), and the
    other four reached the engine. ``json.dumps`` writes the lone surrogate as the
    escape ``\\ud800``, as a client would."""
    server = start()
    body: dict[str, Any] = {"sampling_params": {"max_new_tokens": 2}}
    if path == "/generate":
        body.setdefault("text", "hi")
    elif path == "/v1/completions":
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    else:
        body = {"model": "m", "max_tokens": 2}
    body[field] = value
    registered = server.engine_events("registered")
    escaped = json.dumps(body)  # ensure_ascii: the lone surrogate as its escape
    json_type = {"content-type": "application/json"}
    response = server.request("POST", path, content=escaped, headers=json_type)
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == field, error
    assert "lone surrogate" in error["message"]
    assert server.engine_events("registered") == registered
    emoji = {"text": "\U0001f600 ok", "sampling_params": {"max_new_tokens": 2}}
    assert server.post("/generate", emoji).status_code == 200  # a pair is a character
    server.assert_clean_exit()
    assert "Traceback" not in server.output()


# -- a body in many pieces ----------------------------------------------------------


def test_a_body_in_more_pieces_than_the_bound_is_a_400(start: Callable[..., Server]) -> None:
    """Without this rule a megabyte in 1-byte chunks cost the server 16 s of CPU; now the
    body's 4,097th piece ends it, and a body of ordinary pieces is taken."""
    server = start()
    host, port = server.address
    head = (
        f"POST /generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}}).encode()
    padded = body + b" " * (5000 - len(body))
    with connect(server) as sock:
        sock.sendall(head + b"".join(b"1\r\n%c\r\n" % byte for byte in padded) + b"0\r\n\r\n")
        answer = read_head(sock)
        while b"pieces" not in answer and (more := sock.recv(1 << 16)):
            answer += more
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert b"more than 4096 pieces" in answer, answer
    pieces = [body[i : i + 8] for i in range(0, len(body), 8)]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    with connect(server) as sock:
        sock.sendall(head + chunks + b"0\r\n\r\n")
        assert read_head(sock).startswith(b"HTTP/1.1 200")
    server.assert_clean_exit()
