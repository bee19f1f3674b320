"""``trio-sglang serve`` as the load test's subprocess: started, watched, scraped, stopped.

The server runs as a user runs it (``python -m trio_sglang serve`` on a free loopback
port), in its own process, so that its memory and CPU are its own and the clients' work
does not run on its event loop. ``trio.run_process`` in a nursery owns it: however the
load test ends, a server still running is terminated (``_terminate``) and reaped.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import httpx
import trio

from _load_clients import http_client
from _load_metrics import Scrape
from _subprocesses import served_url

__all__ = ["ServerLog", "ServerProcess", "open_server"]

_QUIET_LEVELS = ("DEBUG", "INFO")
_LEVELS = (*_QUIET_LEVELS, "WARNING", "ERROR", "CRITICAL")
#: Seconds a server gets to exit after SIGTERM, before SIGKILL. trio's own
#: default, 5 s, is too short for a server over SGLang's stand-in scheduler on a
#: busy machine: the interpreters' teardown with SGLang imported takes seconds.
_STOP_GRACE = 30.0


@dataclass(slots=True)
class ServerLog:
    """The server's output (stdout and stderr, one pipe): lines counted by level.

    Lines above INFO, and lines with no level (tracebacks, ``print``), are
    kept, the last 40 of them: enough to see what went wrong, bounded however
    much the server logs under load.
    """

    levels: Counter[str] = field(default_factory=Counter)
    notable: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    url: str | None = None
    #: Set once the server said where it listens, or its output ended.
    ready: trio.Event = field(default_factory=trio.Event)

    def feed(self, line: str) -> None:
        level = line.split(" ", 1)[0]
        self.levels[level if level in _LEVELS else "other"] += 1
        if level not in _QUIET_LEVELS:
            self.notable.append(line)
        if self.url is None and (url := served_url(line)) is not None:
            self.url = url
            self.ready.set()

    async def drain(self, stream: trio.abc.ReceiveStream) -> None:
        pending = b""
        async for chunk in stream:
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self.feed(line.decode(errors="replace"))
        if pending:
            self.feed(pending.decode(errors="replace"))
        self.ready.set()


@dataclass(slots=True)
class ServerProcess:
    process: trio.Process
    url: str
    log: ServerLog
    #: The operator's client (health, metrics), apart from the users' connections.
    admin: httpx.AsyncClient

    async def scrape(self) -> Scrape:
        response = await self.admin.get("/metrics")
        response.raise_for_status()
        return Scrape.parse(response.text)

    async def model(self) -> str:
        response = await self.admin.get("/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])

    async def settled(self) -> Scrape:
        """Poll until no stream is open and no cleanup is in flight (the caller bounds it)."""
        while True:
            scrape = await self.scrape()
            if (
                scrape.value("trio_sglang_cleanup_tasks_in_flight") == 0
                and scrape.value("trio_sglang_open_streams") == 0
            ):
                return scrape
            await trio.sleep(0.05)

    async def settle(self, bound: float) -> tuple[float | None, Scrape]:
        """Wait at most ``bound`` s for ``settled``: the seconds it took (None: not
        within the bound), and a scrape taken after."""
        started = trio.current_time()
        seconds: float | None = None
        with trio.move_on_after(bound):
            await self.settled()
            seconds = trio.current_time() - started
        return seconds, await self.scrape()

    async def stop(self, bound: float) -> tuple[int | None, float]:
        """SIGINT, as a user's Ctrl-C, then wait at most ``bound`` s: the exit status (None:
        still running at the bound) and the seconds waited."""
        started = trio.current_time()
        status: int | None = None
        self.process.send_signal(signal.SIGINT)
        with trio.move_on_after(bound):
            status = await self.process.wait()
        return status, trio.current_time() - started


@asynccontextmanager
async def open_server(
    args: Sequence[str],
    *,
    start_timeout: float,
    http_timeout: float,
    command: Sequence[str] | None = None,
) -> AsyncIterator[ServerProcess]:
    """Start ``trio-sglang serve --port 0 ARGS``; yield it once ``/health`` answers 200.

    ``command``: another server to run instead (then ``ARGS`` follow it), one that
    prints ``serving NAME on URL`` and answers ``/health`` as ``serve`` does.
    """
    if command is None:
        command = [sys.executable, "-m", "trio_sglang", "serve", "--port", "0"]
    command = [*command, *args]
    log = ServerLog()
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                check=False,
                deliver_cancel=_terminate,
            )
        )
        assert process.stdout is not None
        nursery.start_soon(log.drain, process.stdout)
        try:
            with trio.fail_after(start_timeout):
                url = await _healthy(log, http_timeout, shlex.join(command))
            async with http_client(url, http_timeout) as admin:
                yield ServerProcess(process, url, log, admin)
        finally:
            if process.returncode is None:
                nursery.cancel_scope.cancel()


async def _terminate(process: trio.Process) -> None:
    """SIGTERM; SIGKILL if the server has not exited within ``_STOP_GRACE``."""
    process.terminate()
    with trio.move_on_after(_STOP_GRACE):
        await process.wait()
        return
    process.kill()


async def _healthy(log: ServerLog, http_timeout: float, name: str) -> str:
    """The server's URL, once it said where it listens and ``/health`` answers 200."""
    await log.ready.wait()
    if log.url is None:
        output = "\n".join(log.notable)
        raise RuntimeError(f"{name} ended before it served:\n{output}")
    async with http_client(log.url, http_timeout) as probe:
        while True:
            if (await probe.get("/health")).status_code == 200:
                return log.url
            await trio.sleep(0.05)
