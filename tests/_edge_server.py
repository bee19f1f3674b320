"""A ``trio-sglang serve`` process on loopback, and the raw clients that misbehave against it.

Shared by the tests of the HTTP edge (``test_edge.py``, ``test_hostile_clients.py``):
each test starts a real server on the SimEngine and talks to it as a misbehaving
client would, over raw sockets where httpx would be too polite. Every wait is
bounded; every process is reaped.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import parser

from _hostile_clients import unread
from _processes import Process, served_url, wait_until

MODEL = "trio-sglang-sim"
#: Bound on one HTTP call of the test's own (health checks, scrapes, requests).
TIMEOUT = 5.0
#: Bound on "the server holds no request any more" after a client went away.
IDLE_TIMEOUT = 5.0
#: Bound on "/health answers": a server that is not stuck answers in milliseconds.
HEALTH_TIMEOUT = 2.0
#: Longer than any sim stream a test lets run on its own at 1 ms a token (30 s).
LONG = 30_000
#: A small receive buffer, set before connect: the window stays small, so a
#: client that stops reading stops the server's writes after a few kB.
SMALL_RCVBUF = 4096
#: RSS a server may gain while ten clients stall on it (the issue measured 6 MB/s).
RSS_SLACK = 8 << 20


# -- a server process ----------------------------------------------------------


@dataclass
class Server:
    """A ``trio-sglang serve`` process, its URL, and the headers every call of ours sends."""

    process: Process
    url: str
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.popen.pid

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        with httpx.Client(timeout=TIMEOUT, trust_env=False) as client:
            return client.request(method, self.url + path, headers=headers, **kwargs)

    def post(self, path: str, body: object, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, json=body, **kwargs)

    def metric(self, name: str, default: float | None = None, **labels: str) -> float:
        """The sum of ``name``'s samples with ``labels``; ``default`` if it has none."""
        response = self.request("GET", "/metrics")
        assert response.status_code == 200, response.text
        samples = [
            sample
            for family in parser.text_string_to_metric_families(response.text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        ]
        if not samples:
            if default is None:
                raise AssertionError(f"no {name}{labels or ''} on /metrics")
            return default
        return float(sum(sample.value for sample in samples))

    def live(self) -> int:
        return int(self.metric("trio_sglang_engine_live_requests"))

    def engine_events(self, kind: str) -> int:
        """What reached the SimEngine: its ``registered`` count is every request it saw."""
        return int(self.metric("trio_sglang_sim_events_total", kind=kind))

    def rss(self) -> int:
        status = Path(f"/proc/{self.pid}/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        assert match is not None, status
        return int(match.group(1)) * 1024

    def fds(self) -> int:
        return len(list(Path(f"/proc/{self.pid}/fd").iterdir()))

    def output(self) -> str:
        return self.process.output()

    def assert_healthy(self) -> None:
        started = time.monotonic()
        response = self.request("GET", "/health", timeout=HEALTH_TIMEOUT)
        assert response.status_code == 200, response.text
        assert time.monotonic() - started < HEALTH_TIMEOUT

    def wait_idle(self, timeout: float = IDLE_TIMEOUT) -> None:
        """Until the engine holds no request (bounded)."""
        wait_until("no live request", lambda: self.live() == 0, timeout, self.process)

    def signal_and_wait(self, signum: int, within: float) -> int:
        """Send ``signum``; the exit status, which must come within ``within`` seconds."""
        self.process.popen.send_signal(signum)
        return self.wait_exit(within)

    def wait_exit(self, within: float) -> int:
        try:
            return self.process.popen.wait(within)
        except Exception:
            raise AssertionError(f"still running {within} s later\n{self.process.tail()}") from None

    def assert_clean_exit(self, within: float = 5.0) -> None:
        """Healthy and idle now, then SIGTERM: status 0, and no traceback ever logged."""
        self.assert_healthy()
        self.wait_idle()
        status = self.signal_and_wait(signal.SIGTERM, within)
        assert status == 0, self.process.tail()
        assert "Traceback" not in self.output(), self.process.tail()


#: ``python -c`` this ``soft:hard command...``: prlimit's ``--nofile`` where it is missing.
_SET_NOFILE_AND_EXEC = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, tuple(map(int, sys.argv[1].split(':')))); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def launch(
    log: Path, *flags: str, headers: dict[str, str] | None = None, nofile: str | None = None
) -> Server:
    """``python -m trio_sglang serve --port 0 FLAGS``, once it answers HTTP.

    ``nofile`` (``soft:hard``) starts it under ``prlimit --nofile``. Ready means
    /health gets any HTTP answer: a server with ``--allowed-hosts`` may refuse ours.
    """
    command = [sys.executable, "-m", "trio_sglang", "serve", "--port", "0", *flags]
    if nofile is not None:  # both exec the server: its pid is the process's
        prlimit = shutil.which("prlimit")
        if prlimit is not None:
            command = [prlimit, f"--nofile={nofile}", "--", *command]
        else:
            command = [sys.executable, "-c", _SET_NOFILE_AND_EXEC, nofile, *command]
    process = Process(log.stem, command, log)
    try:
        wait_until(
            "the serving line", lambda: served_url(process.output()) is not None, 20, process
        )
        url = served_url(process.output())
        assert url is not None
        server = Server(process, url, headers or {})

        def answers() -> bool:
            try:
                server.request("GET", "/health", timeout=1)
            except httpx.TransportError:
                return False
            return True

        wait_until("/health to answer", answers, 20, process)
    except BaseException:
        process.stop(timeout=2)
        raise
    return server


@contextlib.contextmanager
def servers(folder: Path) -> Iterator[Callable[..., Server]]:
    """``start(*flags, headers=..., nofile=...)``: servers logging into ``folder``, reaped after."""
    started: list[Server] = []

    def start(*flags: str, **kwargs: Any) -> Server:
        server = launch(folder / f"serve-{len(started)}.log", *flags, **kwargs)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.process.stop(timeout=2)


# -- misbehaving clients ---------------------------------------------------------


def request_bytes(
    server: Server, path: str, body: object, headers: dict[str, str] | None = None
) -> bytes:
    payload = json.dumps(body).encode()
    host, port = server.address
    fields = {
        "Host": f"{host}:{port}",
        "Content-Type": "application/json",
        "Content-Length": str(len(payload)),
        **server.headers,
        **(headers or {}),
    }
    head = "".join(f"{name}: {value}\r\n" for name, value in fields.items())
    return f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + payload


def connect(server: Server, *, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the window scale is chosen for it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(TIMEOUT)
    sock.connect(server.address)
    return sock


def read_head(sock: socket.socket) -> bytes:
    """The response's status line and headers (and whatever came with them)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"closed before the response head: {data!r}"
        data += chunk
    return data


def non_reader(server: Server, tokens: int = LONG) -> socket.socket:
    """A streaming ``/generate`` whose client reads the response head, then nothing."""
    sock = connect(server, rcvbuf=SMALL_RCVBUF)
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": tokens}}
    sock.sendall(request_bytes(server, "/generate", body))
    head = read_head(sock)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def closed_within(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closes ``sock`` within ``timeout`` s (what it still sends is drained)."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                return True
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:  # reset: closed too
        return True
    return False


def wait_streaming(sock: socket.socket, still: float = 0.3, timeout: float = 5.0) -> None:
    """Until the server has filled ``sock``'s window: nothing more arrives for ``still`` s.

    Reads nothing: watches the bytes queued in the kernel (``FIONREAD``).
    """
    deadline = time.monotonic() + timeout
    queued, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now_queued = unread(sock)
        if now_queued != queued:
            queued, since = now_queued, time.monotonic()
        elif time.monotonic() - since >= still:
            return
        time.sleep(0.02)
    raise AssertionError(f"the server kept writing to a client that reads nothing ({queued} B)")
