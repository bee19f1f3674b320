"""The HTTP edge: slow, stalled and hostile clients never hold the engine.

Each test runs ``trio-sglang serve`` as a real process on loopback (on the
SimEngine) and talks to it as a misbehaving client would, over raw sockets
where httpx would be too polite. What this file pins, one test per finding:

1. a streaming client that stops reading is gone after ``--client-stall-timeout``:
   its request is stopped at the engine, its connection closed, it is counted
   in ``trio_sglang_clients_dropped_total``, and the server's memory stays flat;
2. SIGTERM/SIGINT with such a client connected still exits, cleanly, within
   the shutdown grace;
3. and 4. ``n`` times the prompts past ``--max-children-per-request``, and a
   ``rid`` past ``--max-rid-length``, are a 400 naming the field, and reach
   nothing in the engine; ``n`` at the cap, faster than its client reads, comes
   coalesced: every token arrives, and the server's memory stays flat;
5. a body (or headers) sent a byte at a time is cut off after
   ``--request-read-timeout`` (``--keep-alive-timeout`` for headers);
6. connects abandoned at once are released at once, not after the keep-alive
   timeout; idle connections past the file-descriptor limit are shed, and the
   server still answers;
7. a second SIGTERM/SIGINT during the grace ends the process promptly, with
   status 128 + signum and no traceback;
8. to 12.: who and what the edge admits, in ``test_edge_admission.py``.

After every case the server is healthy (``/health`` answers at once), holds no
request (``trio_sglang_engine_live_requests`` back to 0), and exits with status 0
on SIGTERM with no traceback in its log. Every wait is bounded; every process
is reaped. The tests marked ``slow`` take a few seconds each (timeouts to run
out); ``-m 'not slow'`` leaves the quick ones.
"""

from __future__ import annotations

import contextlib
import json
import re
import resource
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from _edge_server import (
    MODEL,
    RSS_SLACK,
    TIMEOUT,
    Server,
    closed_within,
    connect,
    launch,
    non_reader,
    read_head,
    request_bytes,
    servers,
    wait_streaming,
)
from _processes import wait_until


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """``start(*flags, headers=..., nofile=...)``: a server for this test, reaped after it."""
    with servers(tmp_path) as starting:
        yield starting


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server on the defaults, for the requests that are only refused."""
    started = launch(tmp_path_factory.mktemp("edge") / "serve-defaults.log")
    try:
        yield started
        started.assert_clean_exit()
    finally:
        started.process.stop(timeout=2)


# -- 1. clients that stop reading ----------------------------------------------------

STALL = 2.0


@pytest.mark.slow
def test_clients_that_stop_reading_are_dropped_after_the_stall_timeout(
    start: Callable[..., Server],
) -> None:
    server = start("--sim-token-interval", "0.001", "--client-stall-timeout", str(STALL))
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 200}}
    assert server.post("/generate", body).status_code == 200  # a reader: its code paths warm
    baseline = server.rss()

    opened = time.monotonic()
    clients = [non_reader(server) for _ in range(10)]
    peak = baseline

    def all_stopped() -> bool:
        nonlocal peak
        peak = max(peak, server.rss())
        return server.live() == 0

    with contextlib.ExitStack() as closing:
        for sock in clients:
            closing.enter_context(sock)
        wait_until("the stalled requests to be stopped", all_stopped, STALL + 6, server.process)
        took = time.monotonic() - opened
        assert took >= STALL * 0.75, f"dropped after {took:.1f} s, before the stall timeout"
        assert all(closed_within(sock, 3) for sock in clients), "a connection was left open"
        dropped = server.metric("trio_sglang_clients_dropped_total", default=0, reason="stalled")
        assert dropped == 10, f'trio_sglang_clients_dropped_total{{reason="stalled"}} is {dropped}'
        assert peak - baseline < RSS_SLACK, f"RSS grew by {(peak - baseline) >> 20} MB"
        after = server.rss()
        time.sleep(1)
        assert server.rss() - after < 1 << 20, "RSS still growing once the clients were dropped"
    # Once for the ten (they stall within the 10 s the line covers), not per client
    # (once, 1,000 slow readers were 1,000 lines), and never per token.
    lines = [line for line in server.output().splitlines() if "stall" in line.lower()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("INFO trio_sglang.server: dropped clients (1 stalled)"), lines
    server.assert_clean_exit()


# -- 2. and 7. shutdown with a client that reads nothing -------------------------------

GRACE = 1.0
SIGNALS = [signal.SIGTERM, signal.SIGINT]


@pytest.mark.slow
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_a_signal_exits_within_the_grace_with_a_non_reader_connected(
    start: Callable[..., Server], signum: signal.Signals
) -> None:
    server = start("--sim-token-interval", "0.001", "--shutdown-grace", str(GRACE))
    with non_reader(server) as sock:
        wait_streaming(sock)
        started = time.monotonic()
        status = server.signal_and_wait(signum, GRACE + 2)
        took = time.monotonic() - started
    assert status == 0, server.process.tail()
    assert took < GRACE + 1, f"exited {took:.1f} s after the signal"
    assert "Traceback" not in server.output(), server.process.tail()


@pytest.mark.slow
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_a_second_signal_skips_the_grace_and_exits_128_plus_signum(
    start: Callable[..., Server], signum: signal.Signals
) -> None:
    server = start("--sim-token-interval", "0.001", "--shutdown-grace", "30")
    with non_reader(server) as sock:
        wait_streaming(sock)
        server.process.popen.send_signal(signum)
        wait_until(
            "the first signal to be logged",
            lambda: f"received {signum.name}" in server.output(),
            5,
            server.process,
        )
        time.sleep(0.3)
        assert server.process.alive(), "the first signal did not wait for the grace"
        started = time.monotonic()
        status = server.signal_and_wait(signum, 5)
        took = time.monotonic() - started
    assert status == 128 + signum, f"status {status}\n{server.process.tail()}"
    assert took < 3, f"exited {took:.1f} s after the second signal"
    assert "Traceback" not in server.output(), server.process.tail()


@pytest.mark.slow
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_signals_until_the_very_end_never_meet_the_default_handler(
    start: Callable[..., Server], signum: signal.Signals
) -> None:
    """A second SIGTERM after the engine closed, in the interpreter's exit, once
    killed the process (status -15, 3 runs in 6). Here signals come every 5 ms from the
    first to the process's end: the status is 0 (the engine closed first) or 128 +
    signum (a signal cut the grace short), never a death by signal, never a traceback."""
    server = start()
    popen = server.process.popen
    popen.send_signal(signum)
    deadline = time.monotonic() + 10
    while popen.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            popen.send_signal(signum)
        time.sleep(0.005)
    status = server.process.wait(5)
    assert status in (0, 128 + signum), f"status {status}\n{server.process.tail()}"
    assert "Traceback" not in server.output(), server.process.tail()


# -- 3. and 4. fan-out past the caps -----------------------------------------------------


def _one_token(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` asking for one token per child (SGLang's field or OpenAI's)."""
    if path == "/generate":
        return {**body, "sampling_params": {**body.get("sampling_params", {}), "max_new_tokens": 1}}
    return {**body, "max_tokens": 1}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"text": "hi", "sampling_params": {"n": 1024}}, "n"),
        ("/generate", {"text": ["a", "b"], "sampling_params": {"n": 200}}, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 200}, "n"),
        ("/generate", {"text": "hi", "rid": "r" * 10_000}, "rid"),
        ("/generate", {"text": ["a", "b"], "rid": ["a", "r" * 500_000]}, "rid"),
    ],
    ids=["n-1024", "2-prompts-n-200", "completions-2-prompts-n-200", "rid-10k", "rid-list-500k"],
)
def test_fan_out_past_the_caps_is_a_400_that_reaches_nothing(
    server: Server, path: str, body: dict[str, Any], param: str
) -> None:
    registered = server.engine_events("registered")
    response = server.post(path, _one_token(path, body))
    assert response.status_code == 400, response.text[:500]
    assert response.json()["error"]["param"] == param, response.text[:500]
    assert len(response.content) < 4096  # the answer does not echo the 500 kB rid back
    assert server.engine_events("registered") == registered
    server.assert_healthy()
    server.wait_idle()


@pytest.mark.slow
def test_n_at_the_cap_outruns_no_reading_client(start: Callable[..., Server]) -> None:
    """256 children at 10 ms a token: 25,600 tokens/s, faster than one client parses them.

    The server coalesces what the client is behind on: every token arrives, the
    client is not dropped, and the server's memory does not grow with the backlog.
    """
    server = start("--sim-token-interval", "0.01")
    baseline = server.rss()
    body = {"text": "hi", "stream": True, "sampling_params": {"n": 256, "max_new_tokens": 300}}
    tokens: dict[int, int] = {}
    finished: dict[int, str] = {}
    peak, events = baseline, 0
    started = time.monotonic()
    with (
        httpx.Client(timeout=TIMEOUT, trust_env=False) as client,
        client.stream("POST", server.url + "/generate", json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                break
            if not line.startswith("data: "):
                continue
            event = json.loads(line.removeprefix("data: "))
            events += 1
            index = event["index"]
            tokens[index] = tokens.get(index, 0) + len(event["output_ids"])
            if (reason := event["meta_info"]["finish_reason"]) is not None:
                finished[index] = reason["type"]
            if events % 500 == 0:
                peak = max(peak, server.rss())
            assert time.monotonic() - started < 15, "the stream is far slower than the engine"
    assert tokens == dict.fromkeys(range(256), 300)
    assert finished == dict.fromkeys(range(256), "length")
    assert server.metric("trio_sglang_clients_dropped_total", default=0) == 0
    assert peak - baseline < 2 * RSS_SLACK, f"RSS grew by {(peak - baseline) >> 20} MB"
    server.assert_clean_exit()


# -- 5. slow requests --------------------------------------------------------------------

READ_TIMEOUT = 1.0


@pytest.mark.slow
@pytest.mark.parametrize("part", ["body", "headers"])
def test_a_request_sent_a_byte_at_a_time_is_cut_off(
    start: Callable[..., Server], part: str
) -> None:
    server = start(
        "--request-read-timeout", str(READ_TIMEOUT), "--keep-alive-timeout", str(READ_TIMEOUT)
    )  # fmt: skip
    request = request_bytes(server, "/generate", {"text": "hi" * 200})
    head, _, body = request.partition(b"\r\n\r\n")
    trickled = body if part == "body" else head + b"\r\n\r\n" + body
    registered = server.engine_events("registered")
    fds = server.fds()
    with connect(server) as sock:
        if part == "body":
            sock.sendall(head + b"\r\n\r\n")
        sent = time.monotonic()
        answered = b""
        for byte in trickled:  # a byte every 50 ms, until the server answers or hangs up
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            if select.select([sock], [], [], 0.05)[0]:
                with contextlib.suppress(OSError):  # a reset: closed, with no answer
                    answered = sock.recv(4096)
                break
            assert time.monotonic() - sent < READ_TIMEOUT + 3, "still reading the trickle"
        took = time.monotonic() - sent
        assert took > READ_TIMEOUT * 0.5, f"cut off after {took:.2f} s, before the timeout"
        if part == "body":
            assert answered.startswith(b"HTTP/1.1 408") or not answered, answered[:200]
        assert closed_within(sock, 2), "the connection stayed open after the timeout"
    assert server.engine_events("registered") == registered
    wait_until("the connection's fd to be released", lambda: server.fds() <= fds + 1, 2)
    server.assert_clean_exit()


# -- 6. connection churn under a low file-descriptor limit ------------------------------


@pytest.mark.slow
def test_abandoned_connects_are_released_at_once(start: Callable[..., Server]) -> None:
    server = start(nofile="256:256")
    server.assert_healthy()
    fds = server.fds()
    for _ in range(40):  # 2,000 connects in bursts of 50, each closed by the client at once
        burst = [socket.create_connection(server.address, timeout=TIMEOUT) for _ in range(50)]
        for sock in burst:
            sock.close()
    # The kernel's accept queue is first in, first out: once a request made after
    # them is answered, every abandoned connection has been accepted and has its EOF.
    assert server.request("GET", "/health", timeout=10).status_code == 200
    wait_until(
        "the abandoned connections to be released (not after the 5 s keep-alive timeout)",
        lambda: server.fds() <= fds + 2,
        1.0,
        server.process,
    )
    server.assert_healthy()
    assert "Too many open files" not in server.output(), server.process.tail()
    server.assert_clean_exit()


@pytest.mark.slow
def test_idle_connections_past_the_fd_limit_leave_room_for_new_ones(
    start: Callable[..., Server],
) -> None:
    server = start(nofile="256:256")
    server.assert_healthy()
    fds = server.fds()
    with contextlib.ExitStack() as closing:
        for _ in range(300):  # more than 256 fds can hold, none sending a byte
            closing.enter_context(socket.create_connection(server.address, timeout=TIMEOUT))
        server.assert_healthy()  # at once, not after their 5 s keep-alive timeout
    wait_until("the fds to be released", lambda: server.fds() <= fds + 2, 2, server.process)
    assert "Too many open files" not in server.output(), server.process.tail()
    server.assert_clean_exit()


#: Idle connections for the memory test, and what each may cost the server: hypercorn's
#: protocol, task group and timer took about 18 KiB a connection before its first byte
#: (measured: 5,000 idle connections, +75 MB); a socket and a parked task, 6.
IDLE_CONNECTIONS = 3000
IDLE_CONNECTION_BYTES = 9 << 10


@contextlib.contextmanager
def idle_connections(server: Server, count: int) -> Iterator[list[socket.socket]]:
    """``count`` connections that send nothing, accepted by the server, closed on exit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 256
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"{count} connections need {wanted} file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    with contextlib.ExitStack() as closing:
        socks = [
            closing.enter_context(socket.create_connection(server.address, timeout=TIMEOUT))
            for _ in range(count)
        ]
        # The accept queue is first in, first out: answered after them, all are accepted.
        server.assert_healthy()
        yield socks
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_connections_that_send_nothing_hold_no_http_state(start: Callable[..., Server]) -> None:
    server = start()
    server.assert_healthy()
    before = server.rss()
    with idle_connections(server, IDLE_CONNECTIONS):
        held = server.rss() - before
        server.assert_healthy()
    # Closed unserved, they leave nothing behind either: an EOF is peeked at, not
    # handed to an HTTP protocol made for it.
    server.assert_healthy()
    left = server.rss() - before
    bound = IDLE_CONNECTIONS * IDLE_CONNECTION_BYTES
    assert held < bound, f"{IDLE_CONNECTIONS} idle connections took {held >> 10} KiB"
    assert left < bound, f"after {IDLE_CONNECTIONS} idle connections closed: +{left >> 10} KiB"
    server.assert_clean_exit()


@pytest.mark.slow
def test_a_late_first_byte_is_served_but_gets_no_second_keep_alive_timeout(
    start: Callable[..., Server],
) -> None:
    keep_alive = 1.5
    server = start("--keep-alive-timeout", str(keep_alive))
    host, port = server.address
    late = connect(server)
    time.sleep(keep_alive / 2)
    late.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    assert read_head(late).startswith(b"HTTP/1.1 200"), "a request sent late was not served"
    late.close()
    # Headers begun late and never finished are cut at the keep-alive timeout from the
    # connect, not from their first byte.
    slow = connect(server)
    connected = time.monotonic()
    time.sleep(keep_alive * 0.6)
    slow.sendall(b"GET /health HTTP/1.1\r\n")
    assert closed_within(slow, keep_alive * 2), "headers never finished kept their connection"
    assert time.monotonic() - connected < keep_alive * 1.4
    slow.close()
    server.assert_clean_exit()


@pytest.mark.slow
def test_shutdown_lets_connections_that_sent_nothing_go_at_once(
    start: Callable[..., Server],
) -> None:
    server = start("--keep-alive-timeout", "30", "--shutdown-grace", "20")
    with idle_connections(server, 50) as socks:
        started = time.monotonic()
        assert server.signal_and_wait(signal.SIGTERM, 10) == 0, server.process.tail()
        assert time.monotonic() - started < 0.9, "shutdown waited for clients that sent nothing"
        assert all(closed_within(sock, 1) for sock in socks)


def test_the_soft_fd_limit_is_raised_to_the_hard_one(start: Callable[..., Server]) -> None:
    server = start(nofile="256:4096")
    limits = Path(f"/proc/{server.pid}/limits").read_text()
    match = re.search(r"^Max open files\s+(\d+)\s+(\d+)", limits, re.MULTILINE)
    assert match is not None, limits
    assert match.groups() == ("4096", "4096"), limits
    server.assert_clean_exit()
