"""Load over loopback: many streaming clients against ``trio-sglang serve``, some leaving.

    python benchmarks/load.py [--quick] [--clients 1000] [--duration 30]
        [--disconnect-fraction 0.333] [--seed 0] [--json PATH]

Starts the server as a subprocess (SimEngine, load-appropriate timing, see
``Config``) on a free loopback port, warms it up, then runs the clients for
the duration: each loops over SGLang's ``/generate`` and OpenAI's
``/v1/completions`` and ``/v1/chat/completions``, streaming, and abandons a
share of its requests at a random moment by closing the connection. After
the run it lets the server settle, stops it with SIGINT, and judges the run
by what the server's ``/metrics`` and the clients saw: no 5xx, no failed
request, nothing left at the engine, no lost abort, no unconfirmed cleanup,
a clean exit. Progress on stderr, the table on stdout, every number in the
JSON; the exit status is 1 if an invariant failed. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from _load_clients import LoadShape, Tally, run_clients
from _load_config import Config
from _load_report import LoadReport, mib
from _load_server import ServerProcess, open_server
from _report import Progress
from cancel_latency import machine

__all__ = ["main", "run_load"]

RESULTS = Path(__file__).resolve().parent / "results"
#: Seconds between progress lines (each also samples the server's memory).
PROGRESS_EVERY = 5.0
#: Any one HTTP exchange of the operator's client (health, metrics).
ADMIN_TIMEOUT = 10.0
QUICK = {"clients": 200, "duration": 8.0, "warmup_clients": 20, "warmup_duration": 1.0}


@dataclass(slots=True)
class _Watch:
    """The progress lines during the load, and the largest server memory they sampled."""

    server: ServerProcess
    shape: LoadShape
    tally: Tally
    progress: Progress
    peak_rss: float | None = None

    async def run(self) -> None:
        started = trio.current_time()
        while True:
            await trio.sleep(PROGRESS_EVERY)
            with trio.move_on_after(PROGRESS_EVERY):  # a slow scrape skips a line
                scrape = await self.server.scrape()
                rss = scrape.get("process_resident_memory_bytes")
                if rss is not None:
                    self.peak_rss = max(rss, self.peak_rss or rss)
                tally = self.tally
                self.progress.start(
                    f"load {trio.current_time() - started:.0f}/{self.shape.duration:g} s: "
                    f"{tally.count():,} requests done ({tally.count('failed'):,} failed), "
                    f"{tally.in_flight:,} in flight; server: "
                    f"{scrape.value('trio_sglang_open_streams'):.0f} streams open, "
                    f"RSS {mib(rss)}"
                )


async def run_load(config: Config, progress: Progress) -> LoadReport:
    """Start the server, warm it up, load it, let it settle, stop it; report."""
    load_average = os.getloadavg()[0]
    started = time.perf_counter()
    progress.start(f"starting trio-sglang serve {' '.join(config.serve_args())}")
    async with open_server(
        config.serve_args(), start_timeout=config.start_timeout, http_timeout=ADMIN_TIMEOUT
    ) as server:
        progress.step_done()
        model = await server.model()
        warmup, shape = Tally(), config.shape(warmup=True)
        progress.start(f"warm-up: {shape.clients} clients for {shape.duration:g} s")
        await run_clients(server.url, model, shape, warmup)
        with trio.fail_after(config.settle_timeout):
            before = await server.settled()
        progress.step_done()

        tally, shape = Tally(), config.shape()
        progress.start(f"load: {shape.clients:,} clients for {shape.duration:g} s")
        watch = _Watch(server, shape, tally, progress, before.get("process_resident_memory_bytes"))
        load_started, cpu_started = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            await run_clients(server.url, model, shape, tally)
            nursery.cancel_scope.cancel()
        load_s = time.perf_counter() - load_started
        client_cpu_s = time.process_time() - cpu_started
        progress.step_done()

        progress.start("settling: the server's last cleanups")
        settle_started = trio.current_time()
        settle_s: float | None = None
        with trio.move_on_after(config.settle_timeout):
            await server.settled()
            settle_s = trio.current_time() - settle_started
        after = await server.scrape()
        progress.step_done()

        progress.start("stopping the server with SIGINT")
        stop_started = trio.current_time()
        exit_status: int | None = None
        server.interrupt()
        with trio.move_on_after(config.stop_timeout):
            exit_status = await server.process.wait()
        stop_s = trio.current_time() - stop_started
        progress.step_done()
    return LoadReport(
        config=config,
        tally=tally,
        warmup=warmup,
        before=before,
        after=after,
        settle_s=settle_s,
        peak_rss=watch.peak_rss,
        exit_status=exit_status,
        stop_s=stop_s,
        log_levels=dict(server.log.levels),
        log_notable=list(server.log.notable),
        load_s=load_s,
        runtime_s=time.perf_counter() - started,
        client_cpu_s=client_cpu_s,
        load_average=(load_average, os.getloadavg()[0]),
    )


# -- the command line ---------------------------------------------------------------


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    defaults = Config()
    parser = argparse.ArgumentParser(
        prog="load.py",
        description="Many streaming clients against trio-sglang serve over loopback, a share "
        "of them disconnecting at random moments; judged by the server's /metrics.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"the CI run: {QUICK['clients']} clients for {QUICK['duration']:g} s "
        "(the options below still apply)",
    )
    parser.add_argument("--clients", type=_count, help=f"default {defaults.clients}")
    parser.add_argument(
        "--duration", type=_seconds, help=f"seconds (default {defaults.duration:g})"
    )
    parser.add_argument(
        "--disconnect-fraction",
        type=_fraction,
        help="share of requests abandoned at a random moment, half of them before the first "
        "token (default 1/3)",
    )
    parser.add_argument("--seed", type=int, help="default 0")
    parser.add_argument(
        "--token-interval",
        type=_seconds,
        help=f"the SimEngine's seconds between tokens (default {defaults.token_interval:g})",
    )
    parser.add_argument(
        "--max-tokens", type=_count, help=f"tokens per request (default {defaults.max_tokens})"
    )
    parser.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="where the results go (default benchmarks/results/load.json, "
        "load-quick.json with --quick)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    chosen: dict[str, Any] = dict(QUICK) if args.quick else {}
    for name in (
        "clients",
        "duration",
        "disconnect_fraction",
        "seed",
        "token_interval",
        "max_tokens",
    ):
        if getattr(args, name) is not None:
            chosen[name] = getattr(args, name)
    return Config(**chosen)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    path = args.json or RESULTS / ("load-quick.json" if args.quick else "load.json")
    print(
        f"SimEngine timing for load: {' '.join(config.serve_args())}; {config.max_tokens} "
        "tokens per request (why: Config in benchmarks/_load_config.py)",
        file=sys.stderr,
    )
    progress = Progress(total=5)
    report = trio.run(run_load, config, progress)
    progress.finish()
    print(report.format())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(machine()), indent=2) + "\n")
    print(f"\nJSON: {path}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
