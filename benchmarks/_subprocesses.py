"""Subprocesses for tests and benchmarks: each logs to a file, and every wait is bounded.

No pipe to fill up, and ``stop`` always ends with the process reaped:
SIGTERM, then SIGKILL. No event announces another process's state either,
so it is polled, through one loop (``poll_until``, and ``wait_until`` that
fails at its bound) over the few probes here (``healthy``, ``gauge``,
``answer_json``). The multi-worker tests import it too
(``tests/_processes.py``), so that one copy of this exists.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "Process",
    "answer_json",
    "free_port",
    "gauge",
    "healthy",
    "poll_until",
    "served_url",
    "wait_until",
]

#: What ``serve`` (and the benchmarks' own HTTP servers) print once they listen.
_SERVING = re.compile(r"serving \S+ on (http://\S+)")


def free_port() -> int:
    """A loopback port that was free a moment ago (for programs that cannot bind port 0)."""
    (port,) = free_ports(1)
    return port


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago.

    Held all at once while they are picked: two calls of ``free_port`` may
    name the same port, which one program given both then fails to bind twice.
    """
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def served_url(output: str) -> str | None:
    """The URL of the "serving MODEL on URL" line in ``output``, once it is there."""
    found = _SERVING.search(output)
    return None if found is None else found.group(1)


def answer_json(url: str) -> Any:
    """What ``url`` answers, as JSON, once it answers with 200 (None before)."""
    try:
        response = httpx.get(url, timeout=2)
        return response.json() if response.status_code == 200 else None
    except (httpx.TransportError, ValueError):  # not up yet, or not JSON
        return None


def gauge(url: str, name: str, *, default: float | None = None, timeout: float = 5.0) -> float:
    """The sample ``name`` (its labels written out, if it has any) of ``url``'s ``/metrics``;
    ``default`` where the server shows none (None: a server that must show it)."""
    text = httpx.get(f"{url}/metrics", timeout=timeout).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if found is not None:
        return float(found.group(1))
    if default is None:
        raise AssertionError(f"{url}/metrics has no {name}")
    return default


def healthy(url: str, timeout: float = 30.0) -> bool:
    """Whether the server at ``url`` answers ``/health`` with 200.

    SGLang's own ``/health`` (``serve --engine sglang`` answers with it) has no
    body, answers 503 until the server has warmed up, and may take a second.
    """
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return bool(response.status == 200)
    except OSError:  # not up yet, a 503 (urllib's HTTPError), a reset
        return False


class Process:
    """A subprocess whose stdout and stderr go to ``log``."""

    def __init__(
        self, name: str, args: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.args = list(args)
        self.log = log
        with log.open("wb") as out:  # the child keeps its own copy of the descriptor
            self.popen = subprocess.Popen(
                self.args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.name} ({' '.join(self.args)}) ---\n{self.output()[-chars:]}"

    def signal(self, signum: int) -> None:
        if self.alive():
            self.popen.send_signal(signum)

    def wait(self, timeout: float) -> int:
        """The exit status; ``subprocess.TimeoutExpired`` if still running after ``timeout``."""
        return self.popen.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; always reaps the process."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        self.popen.wait()


def wait_until(
    what: str, ready: Callable[[], bool], timeout: float, *watched: Process, poll: float = 0.01
) -> float:
    """``poll_until``, failing after ``timeout`` s: the seconds it took."""
    took = poll_until(ready, timeout, *watched, what=what, poll=poll)
    if took is None:
        tails = "\n".join(process.tail() for process in watched)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tails}")
    return took


def poll_until(
    ready: Callable[[], bool],
    timeout: float,
    *watched: Process,
    what: str = "a condition",
    poll: float = 0.01,
) -> float | None:
    """Poll ``ready`` until true; the seconds it took, or None once ``timeout`` s went by.

    The one poll of another process's state (no event announces it here): it
    fails as soon as a watched process exits, and a benchmark that times the
    wait counts a timeout as a finding rather than failing (``wait_until`` fails).
    """
    start = time.monotonic()
    deadline = start + timeout
    while True:
        if ready():
            return time.monotonic() - start
        for process in watched:
            if not process.alive():
                raise AssertionError(
                    f"{process.name} exited ({process.popen.returncode}) while waiting for "
                    f"{what}\n{process.tail()}"
                )
        if time.monotonic() > deadline:
            return None
        time.sleep(poll)
