"""Subprocesses for the multi-worker tests: ``trio-sglang serve`` workers and sglang-router.

Every process logs to a file (no pipe to fill up), every wait is bounded, and
``stop`` always ends with the process reaped: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

__all__ = ["Process", "free_port", "start_router", "start_workers", "wait_until"]

_SERVING = re.compile(r"serving \S+ on (http://\S+)")


def free_port() -> int:
    """A loopback port that was free a moment ago (for programs that cannot bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Process:
    """A subprocess whose stdout and stderr go to ``log``."""

    def __init__(self, name: str, args: Sequence[str], log: Path) -> None:
        self.name = name
        self.args = list(args)
        self.log = log
        with log.open("wb") as out:  # the child keeps its own copy of the descriptor
            self.popen = subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.name} ({' '.join(self.args)}) ---\n{self.output()[-chars:]}"

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
    what: str, ready: Callable[[], bool], timeout: float, *watched: Process, poll: float = 0.05
) -> None:
    """Poll ``ready`` until true; fail after ``timeout`` s or as soon as a watched process exits."""
    deadline = time.monotonic() + timeout
    while True:
        if ready():
            return
        for process in watched:
            if not process.alive():
                raise AssertionError(
                    f"{process.name} exited ({process.popen.returncode}) while waiting for "
                    f"{what}\n{process.tail()}"
                )
        if time.monotonic() > deadline:
            tails = "\n".join(process.tail() for process in watched)
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tails}")
        time.sleep(poll)


def _get_json(url: str) -> Any:
    try:
        response = httpx.get(url, timeout=2)
        return response.json() if response.status_code == 200 else None
    except (httpx.TransportError, ValueError):  # not up yet, or not JSON
        return None


def _wait_serving(process: Process, timeout: float) -> str:
    """The URL ``serve`` reports, once /health answers 200 there."""
    output = ""

    def reported() -> bool:
        nonlocal output
        output = process.output()
        return _SERVING.search(output) is not None

    wait_until(f"{process.name} to report its URL", reported, timeout, process)
    match = _SERVING.search(output)
    assert match is not None
    url = match.group(1)
    wait_until(
        f"{process.name} to answer /health",
        lambda: _get_json(f"{url}/health") is not None,
        timeout,
        process,
    )
    return url


def start_workers(
    names: Sequence[str], log_dir: Path, *args: str, timeout: float = 30.0
) -> list[tuple[Process, str]]:
    """``python -m trio_sglang serve --port 0 ARGS`` once per name, started together.

    Returns each process and its URL once its /health answers 200.
    """
    command = [sys.executable, "-m", "trio_sglang", "serve", "--port", "0", *args]
    started: list[Process] = []
    try:
        for name in names:
            started.append(Process(name, command, log_dir / f"{name}.log"))
        workers = [(process, _wait_serving(process, timeout)) for process in started]
    except BaseException:
        for process in started:
            process.stop()
        raise
    return workers


def start_router(
    log_dir: Path,
    worker_urls: Sequence[str],
    *args: str,
    timeout: float = 30.0,
    watched: Sequence[Process] = (),
) -> tuple[Process, str]:
    """sglang-router on loopback in front of ``worker_urls``.

    Returns once its ``/workers`` lists every worker as healthy; fails early if
    the router or one of the ``watched`` processes (the workers) exits.
    """
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    process = Process("sglang-router", [*command, *args], log_dir / "sglang-router.log")
    url = f"http://127.0.0.1:{port}"

    def all_registered() -> bool:
        listing = _get_json(f"{url}/workers")
        if not isinstance(listing, dict):
            return False
        healthy = {w.get("url") for w in listing.get("workers", []) if w.get("is_healthy")}
        return set(worker_urls) <= healthy

    try:
        wait_until(
            "the router to register every worker", all_registered, timeout, process, *watched
        )
    except BaseException:
        process.stop()
        raise
    return process, url
