"""Bad answers from a decode server's peers end one request, never the process.

A decode server reads answers from other servers: its KV rooms' long polls
(at whatever bootstrap address a request names, within
``--allowed-bootstrap-hosts``) and its ``--prefill-url`` peer's
``/capabilities`` and ``/generate``. A hostile peer here answers each of
those with one of ``ANSWERS``: a nesting deep enough to end a recursive
parser, a body that never ends, one that trickles a byte at a time, a
compression bomb, bytes that are not HTTP, a wrong shape, or nothing. Without
these bounds, the first ended the server with a ``RecursionError`` and the
second with a ``MemoryError`` after 2.7 GB.

``HTTPPrefill`` and ``HTTPKVRooms`` are checked in-process (each bad answer
is a ``PrefillFailed``, or a poll that saw nothing, within its bound), then a
decode ``serve`` process is sent requests whose peer answers badly, and must
still answer ``/health``, hold nothing, and exit 0 on SIGTERM.
"""

from __future__ import annotations

import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import trio

from _load_bad_peer import ANSWERS as LOAD_ANSWERS
from _load_bad_peer import PeerAnswer, http_answer
from _processes import Process, start_workers, wait_until
from trio_sglang import PrefillFailed
from trio_sglang.server import HTTPKVRooms, HTTPPrefill, open_http_kv_rooms
from trio_sglang.sim import BootstrapAddr

#: A good ``/capabilities`` of a prefill server, for the peers whose ``/generate`` is bad.
CAPABILITIES = b'{"role": "prefill"}'


def _sse(*events: bytes) -> Callable[[socket.socket], None]:
    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        for event in events:
            conn.sendall(event)

    return answer


def _endless_sse_line(conn: socket.socket) -> None:
    _sse(b"data: ")(conn)
    while True:
        conn.sendall(b"1" * 65536)


#: Streams for ``bench-endpoint``'s clients, behind a metrics page it can read.
STREAMS: dict[str, Callable[[socket.socket], None]] = {
    "endless-line": _endless_sse_line,
    "deep-event": _sse(b"data: " + b"[" * 100_000 + b"\n\n"),
    "not-json": _sse(b"data: {nope\n\n"),
}


#: The load test's bad answers (its bad KV peers'), and a few more.
ANSWERS: dict[str, PeerAnswer] = {
    **LOAD_ANSWERS,
    "deep-error": PeerAnswer(http_answer(b"{" * 100_000, status=b"500 Oops")),
    "deflate": PeerAnswer(http_answer(zlib.compress(b"{}"), b"content-encoding: deflate")),
    "html": PeerAnswer(http_answer(b"<html>busy</html>")),
    "empty": PeerAnswer(b""),
}


def _play(answer: PeerAnswer, conn: socket.socket) -> None:
    """As the load test's peer plays it, on a blocking socket."""
    conn.sendall(answer.first)
    for _ in range(answer.times):
        time.sleep(answer.every)
        conn.sendall(answer.then)
    if answer.hold:
        time.sleep(60)


class _Peer(socketserver.ThreadingTCPServer):
    """A peer that answers every request with one bad answer (``answer``), or by room.

    A room's number picks its answer, in ``ANSWERS``' order; ``/capabilities``
    is answered well if ``good_capabilities``.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer = "nested 100,000 deep"
        self.good_capabilities = False
        self.good_metrics = False

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class _Handler(socketserver.BaseRequestHandler):
    server: _Peer

    def handle(self) -> None:
        conn = self.request
        conn.settimeout(5)
        try:
            head = conn.recv(65536)
            target = head.split(b" ", 2)[1].decode() if head.count(b" ") >= 2 else "/"
            path = target.split("?", 1)[0]
            if path == "/capabilities" and self.server.good_capabilities:
                conn.sendall(http_answer(CAPABILITIES))
                return
            if path == "/metrics" and self.server.good_metrics:
                conn.sendall(http_answer(b"fake_in_flight 0\n"))
                return
            name = self.server.answer
            if name in STREAMS:
                STREAMS[name](conn)
                return
            if path.startswith("/bootstrap/rooms/"):
                name = list(ANSWERS)[int(path.rsplit("/", 1)[1]) % len(ANSWERS)]
            _play(ANSWERS[name], conn)
        except OSError:  # the server under test gave up on the answer: as it should
            pass


@pytest.fixture
def peer() -> Iterator[_Peer]:
    server = _Peer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("answer", list(ANSWERS))
async def test_a_prefill_peers_bad_answer_fails_the_leg(peer: _Peer, answer: str) -> None:
    peer.answer = answer
    url = f"http://127.0.0.1:{peer.port}"
    with trio.fail_after(10):
        async with HTTPPrefill(
            url, prefill_timeout=1.0, timeout=1.0, max_answer_bytes=1 << 20
        ) as prefill:
            with pytest.raises(PrefillFailed) as capabilities:
                await prefill.capabilities()
            with pytest.raises(PrefillFailed) as leg:
                await prefill.prefill({"text": "hi", "sampling_params": {}}, "req-1")
    for failure in (capabilities.value, leg.value):
        assert url in str(failure)
        assert len(str(failure)) < 400  # one readable line, not the answer


async def test_bad_room_answers_are_polls_that_saw_nothing(peer: _Peer) -> None:
    """Each room's poll meets one bad answer; the waits end at their own bound, quietly."""
    at = BootstrapAddr("127.0.0.1", peer.port)
    with trio.fail_after(15):
        async with open_http_kv_rooms(
            hold=0.2, http_timeout=0.5, retry_interval=0.05, delivery_timeout=1.0
        ) as rooms:
            async with trio.open_nursery() as nursery:
                for room in range(len(ANSWERS)):
                    nursery.start_soon(_wait_briefly, rooms, room, at)
                    rooms.post(room, "decode_ready", at)
            for room in range(len(ANSWERS)):
                assert not rooms.happened(room, "kv_sent", at)
                rooms.side_done(room, at)


async def _wait_briefly(rooms: HTTPKVRooms, room: int, at: BootstrapAddr) -> None:
    with trio.move_on_after(2.0) as bound:
        await rooms.wait(room, frozenset({"kv_sent"}), at)
    assert bound.cancelled_caught


@pytest.fixture
def decode(tmp_path: Path) -> Iterator[Callable[..., tuple[Process, str]]]:
    """Starts a decode ``serve`` with the given flags; at the end, checks that it lived."""
    started: list[tuple[Process, str]] = []

    def start(*args: str) -> tuple[Process, str]:
        role = ("--disaggregation-mode", "decode")
        started.extend(start_workers(["decode"], tmp_path, *role, *args))
        return started[-1]

    yield start
    for process, url in started:
        try:
            _lives(process, url)
        finally:
            process.stop()


def _lives(process: Process, url: str) -> None:
    """Answers ``/health`` at once, holds no request, and exits 0 on SIGTERM, untroubled."""
    with httpx.Client(timeout=5, trust_env=False) as client:
        assert client.get(f"{url}/health").status_code == 200
        wait_until(
            "the decode server to hold no request",
            lambda: "trio_sglang_engine_live_requests 0.0" in client.get(f"{url}/metrics").text,
            10,
            process,
        )
    process.signal(signal.SIGTERM)
    assert process.wait(10) == 0, process.tail()
    assert "Traceback" not in process.output()


@pytest.mark.slow
def test_a_decode_server_lives_through_bad_room_answers(
    peer: _Peer, decode: Callable[..., tuple[Process, str]]
) -> None:
    _, url = decode("--allowed-bootstrap-hosts", "127.0.0.1")
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}, "stream": True}
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": peer.port}
    with httpx.Client(timeout=5, trust_env=False) as client:
        for room in range(len(ANSWERS)):
            request = {**body, **fields, "bootstrap_room": room}
            # The client leaves while the decode side still waits for its KV cache
            # (a stream of heartbeats meanwhile): after 1.5 s, or at the stream's end.
            leave = time.monotonic() + 1.5
            with client.stream("POST", f"{url}/generate", json=request) as response:
                assert response.status_code == 200
                for _ in response.iter_bytes():
                    if time.monotonic() > leave:
                        break


@pytest.mark.slow
def test_a_decode_server_lives_through_bad_prefill_answers(
    peer: _Peer, decode: Callable[..., tuple[Process, str]]
) -> None:
    peer.good_capabilities = True
    process, url = decode("--prefill-url", f"http://127.0.0.1:{peer.port}")
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
    with httpx.Client(timeout=30, trust_env=False) as client:
        for answer in ANSWERS:
            if answer in ("trickle", "hang"):
                continue  # bounded by the 300 s prefill timeout: the in-process test above
            peer.answer = answer
            response = client.post(f"{url}/generate", json=body)
            assert response.status_code == 502, (answer, response.text)
            assert "failed (PrefillFailed)" in response.json()["error"]["message"]
    # Why, in the server's log (not in the client's answer).
    assert process.output().count("engine fault prefill_failed") == len(ANSWERS) - 2


@pytest.mark.slow
@pytest.mark.parametrize("answer", list(ANSWERS))
def test_bench_endpoint_against_a_bad_server_refuses_in_one_line(peer: _Peer, answer: str) -> None:
    """Without this rule a trickled metrics page hung it, an endless one or an endless SSE
    line grew it to 3.8 GB (a raw MemoryError), nested JSON was a RecursionError traceback.

    Here every answer the server gives is bad, its metrics page included: the run
    stops at the first (the server cannot be measured), in one line that names it,
    exit status 2, within the scrape's bound (10 s).
    """
    peer.answer = answer
    command = [
        sys.executable, "-m", "trio_sglang", "bench-endpoint",
        "--url", f"http://127.0.0.1:{peer.port}", "--request-timeout", "5",
    ]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert time.monotonic() - started < 30
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"http://127.0.0.1:{peer.port}/metrics" in last, last  # which answer was bad
    assert "Traceback" not in result.stderr
    assert len(last) < 500


@pytest.mark.slow
@pytest.mark.parametrize("stream", list(STREAMS))
def test_bench_endpoint_refuses_a_stream_it_cannot_read(peer: _Peer, stream: str) -> None:
    """A stream whose line never ends, or whose event is nested too deep or is not JSON:
    the warm-up's requests fail on it, and the run is refused in one line naming why."""
    peer.answer, peer.good_metrics = stream, True
    command = [
        sys.executable, "-m", "trio_sglang", "bench-endpoint",
        "--url", f"http://127.0.0.1:{peer.port}", "--request-timeout", "10",
        "--metrics", "in_flight=fake_in_flight", "--model", "m",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "no warm-up request got a token" in last, last
    why = "a line of more than" if stream == "endless-line" else "not JSON (or nested too deep)"
    assert why in last, last
    assert "Traceback" not in result.stderr
