"""One server's life in a load run: start, warm-up, load phases, stop.

The edge scenario runs two phases on the same server, without and with the hostile
share, so that both see the same process, flags and warm-up; each is judged as a load
run of its own (``Run.report``), between the scrape before it and the one after it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

from _load_clients import LoadShape, Tally, run_clients
from _load_config import Config
from _load_metrics import RssTrace, Scrape
from _load_report import LoadReport
from _load_server import ServerProcess, open_server
from _output import Progress
from _units import mib

__all__ = ["Beside", "Phase", "Run", "progress_steps", "run_server"]

#: Seconds between progress lines.
PROGRESS_EVERY = 5.0

#: What a phase runs beside the users, given the server's URL and model name.
Beside = Callable[[str, str], Awaitable[None]]


def progress_steps(phases: int) -> int:
    """The progress bar's steps: the start, the warm-up, two per phase, the stop."""
    return 3 + 2 * phases


@dataclass(slots=True)
class Phase:
    """What one phase measured."""

    label: str
    tally: Tally
    rss: RssTrace
    #: From the phase's start until its last client (hostile ones included) ended.
    load_s: float
    #: This process's CPU over ``load_s``: the clients' cost.
    client_cpu_s: float
    #: Seconds the server took to settle after the load (None: not within the bound).
    settle_s: float | None
    #: The scrape after the settle.
    after: Scrape


@dataclass(slots=True)
class Run:
    """The server's life: its warm-up, its phases, its exit; this process's cost."""

    config: Config
    warmup: Tally
    #: The scrape after the warm-up (the server settled): where the first phase starts.
    before: Scrape
    phases: list[Phase]
    #: The exit status after SIGINT (None: still running at the bound).
    exit_status: int | None
    stop_s: float
    log_levels: dict[str, int]
    log_notable: list[str]
    #: Start-up to exit, and this process's CPU over it.
    runtime_s: float
    cpu_s: float
    #: The 1-minute load average before the start and after the exit.
    load_average: tuple[float, float]

    def report(self, index: int = 0) -> LoadReport:
        """Phase ``index`` as a load run of its own: from the scrape before it to its own."""
        phase = self.phases[index]
        return LoadReport(
            config=self.config,
            tally=phase.tally,
            warmup=self.warmup,
            before=self.before if index == 0 else self.phases[index - 1].after,
            after=phase.after,
            settle_s=phase.settle_s,
            peak_rss=phase.rss.peak,
            exit_status=self.exit_status,
            stop_s=self.stop_s,
            log_levels=self.log_levels,
            log_notable=self.log_notable,
            load_s=phase.load_s,
            runtime_s=self.runtime_s,
            client_cpu_s=phase.client_cpu_s,
            load_average=self.load_average,
            rss=phase.rss,
        )


async def run_server(
    config: Config,
    progress: Progress,
    phases: Sequence[tuple[str, Beside | None]],
    extra_args: Sequence[str] = (),
) -> Run:
    """Start the server, warm it up, run each (label, beside) phase, stop it."""
    load_average = os.getloadavg()[0]
    started, cpu_started = time.perf_counter(), time.process_time()
    args = [*config.serve_args(), *extra_args]
    progress.start(f"starting trio-sglang serve {' '.join(args)}")
    async with open_server(
        args, start_timeout=config.start_timeout, http_timeout=config.admin_timeout
    ) as server:
        progress.step_done()
        model = await server.model()
        warmup, before = await _warm_up(server, model, config, progress)
        done = [
            await _run_phase(server, model, config, progress, label, beside)
            for label, beside in phases
        ]
        progress.start("stopping the server with SIGINT")
        exit_status, stop_s = await server.stop(config.stop_timeout)
        progress.step_done()
    return Run(
        config=config,
        warmup=warmup,
        before=before,
        phases=done,
        exit_status=exit_status,
        stop_s=stop_s,
        log_levels=dict(server.log.levels),
        log_notable=list(server.log.notable),
        runtime_s=time.perf_counter() - started,
        cpu_s=time.process_time() - cpu_started,
        load_average=(load_average, os.getloadavg()[0]),
    )


async def _warm_up(
    server: ServerProcess, model: str, config: Config, progress: Progress
) -> tuple[Tally, Scrape]:
    """A few users for a moment, then the settled server's scrape the first phase starts from."""
    warmup, shape = Tally(), config.shape(warmup=True)
    progress.start(f"warm-up: {shape.clients} clients for {shape.duration:g} s")
    await run_clients(server.url, model, shape, warmup)
    with trio.fail_after(config.settle_timeout):
        before = await server.settled()
    progress.step_done()
    return warmup, before


async def _run_phase(
    server: ServerProcess,
    model: str,
    config: Config,
    progress: Progress,
    label: str,
    beside: Beside | None,
) -> Phase:
    """The users for the duration and ``beside`` them what else the phase runs; the settle."""
    tally, shape = Tally(), config.shape()
    rss = RssTrace(server.process.pid)
    progress.start(f"{label}: {shape.clients:,} clients for {shape.duration:g} s")
    async with trio.open_nursery() as sampling:
        sampling.start_soon(rss.run)
        started, cpu_started = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as watching:
            watching.start_soon(_watch, server, shape, tally, rss, progress, label)
            async with trio.open_nursery() as clients:
                clients.start_soon(run_clients, server.url, model, shape, tally)
                if beside is not None:
                    clients.start_soon(beside, server.url, model)
            watching.cancel_scope.cancel()
        load_s = time.perf_counter() - started
        client_cpu_s = time.process_time() - cpu_started
        progress.step_done()
        progress.start(f"{label}: settling, the server's last cleanups")
        settle_s, after = await server.settle(config.settle_timeout)
        sampling.cancel_scope.cancel()
    progress.step_done()
    return Phase(label, tally, rss, load_s, client_cpu_s, settle_s, after)


async def _watch(
    server: ServerProcess,
    shape: LoadShape,
    tally: Tally,
    rss: RssTrace,
    progress: Progress,
    label: str,
) -> None:
    """A progress line every ``PROGRESS_EVERY`` s during the load."""
    started = trio.current_time()
    while True:
        await trio.sleep(PROGRESS_EVERY)
        with trio.move_on_after(PROGRESS_EVERY):  # a slow scrape skips a line
            scrape = await server.scrape()
            elapsed = trio.current_time() - started
            progress.start(
                f"{label} {elapsed:.0f}/{shape.duration:g} s: "
                f"{tally.count():,} requests done ({tally.count('failed'):,} failed), "
                f"{tally.in_flight:,} in flight; server: "
                f"{scrape.value('trio_sglang_open_streams'):.0f} streams open, "
                f"RSS {mib(rss.latest)}"
            )
