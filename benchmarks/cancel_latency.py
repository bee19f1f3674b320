"""Cancel-latency benchmark: trio-sglang's lifecycle against the anchors' strategies.

    python benchmarks/cancel_latency.py [--quick | --full] [--out DIR]
        [--json PATH] [--plot PATH] [--concurrency 1,100,1000] [--phases tokenizing,...]

What it measures and prints, its sizes and the files it writes are in
docs/benchmarks.md ("Running it", "Method"). Everything runs in this one
process, in real time, each measurement on a fresh ``SimEngine``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import io
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from trio.testing import MockClock

from _approaches import APPROACHES, ENGINE_ALONE
from _cells import CellPlan, run_at_once, run_cell
from _output import Progress, add_file_options, cores, machine, results_folder, write_json
from _overhead import memory_per_request, throughput_ratio
from _phases import PHASES
from _report import Report, summary_markdown
from _shutdown import shutdown_time
from _trio_floor import bare_trio_burst_ms
from _verdict import judge_machine

if TYPE_CHECKING:
    from trio_sglang_harness import Caller

__all__ = ["SIZES", "Config", "Size", "main", "run_benchmark"]


@dataclass(frozen=True, slots=True)
class Size:
    """How much one run measures: ``--quick``, the default, ``--full``."""

    concurrency: tuple[int, ...]
    #: Small concurrencies repeat their wave until a cell has this many cancels.
    min_cancels: int
    #: The at-once burst for the baselines too (else trio-sglang's only).
    at_once_baselines: bool
    at_once_gc_frozen: bool
    memory_streams: int
    throughput_rounds: int
    throughput_tokens: int


SIZES = {
    # CI's subset: under a minute.
    "quick": Size((1, 100), 5, False, False, 1000, 2, 500),
    # The headline, about 2 minutes on 2 cores: every phase and approach up to 1,000 streams.
    "default": Size((1, 100, 1000), 10, True, False, 10_000, 3, 1000),
    # The whole sweep: 10,000 streams per phase for trio-sglang, the gc-frozen burst.
    "full": Size((1, 100, 1000, 10_000), 20, True, True, 10_000, 5, 1000),
}


@dataclass(frozen=True, slots=True)
class Config:
    """One run's plan. Zero for a count skips that part."""

    #: (phase, concurrency) cells; each runs for every approach in ``approaches``.
    grid: tuple[tuple[str, int], ...]
    #: Which of ``SIZES`` it came from ("custom": built in code).
    size: str = "custom"
    approaches: tuple[str, ...] = tuple(APPROACHES)
    #: Baselines run only up to this concurrency (they are not what is being proven at 10,000).
    baseline_max_concurrency: int = 1000
    #: Small concurrencies repeat their wave until a cell has at least this many cancels.
    min_cancels: int = 20
    arrival_rate: float = 1000.0
    seed: int = 0
    settle_timeout: float = 10.0
    at_once: int = 10_000
    at_once_approaches: tuple[str, ...] = tuple(APPROACHES)
    #: Also run trio-sglang's at-once scenario with the collector frozen.
    at_once_gc_frozen: bool = True
    memory_streams: int = 10_000
    throughput_rounds: int = 5
    throughput_streams: int = 100
    throughput_tokens: int = 1000
    shutdown_pending: int = 1000

    def cells(self) -> list[CellPlan]:
        plans = []
        for phase, concurrency in self.grid:
            for approach in self.approaches:
                if approach != "trio-sglang" and concurrency > self.baseline_max_concurrency:
                    continue
                plans.append(
                    CellPlan(
                        approach,
                        PHASES[phase],
                        concurrency,
                        waves=max(1, math.ceil(self.min_cancels / concurrency)),
                        seed=self.seed,
                        arrival_rate=self.arrival_rate,
                        settle_timeout=self.settle_timeout,
                    )
                )
        return plans

    def at_once_runs(self) -> list[tuple[str, bool]]:
        if not self.at_once:
            return []
        runs = [(approach, False) for approach in self.at_once_approaches]
        if self.at_once_gc_frozen and "trio-sglang" in self.at_once_approaches:
            runs.append(("trio-sglang", True))
        return runs

    def steps(self) -> int:
        extras = bool(self.throughput_rounds) + bool(self.memory_streams)
        extras += bool(self.shutdown_pending)
        return len(self.cells()) + len(self.at_once_runs()) + extras

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["phases"] = {name: PHASES[name].knobs() for name, _ in self.grid}
        data["phase_windows"] = {name: PHASES[name].window for name, _ in self.grid}
        return data


async def run_benchmark(config: Config, progress: Progress | None = None) -> Report:
    """Run everything the config asks for, in order: overhead, cells, at-once, shutdown."""
    steps = Progress(config.steps(), stream=io.StringIO()) if progress is None else progress
    report = Report(config=config.to_json(), cores=cores())
    load_before = os.getloadavg()
    started = time.perf_counter()
    cpu_started = time.process_time()
    if config.throughput_rounds:
        steps.start("throughput: worker.generate vs the engine directly")
        report.throughput = await throughput_ratio(
            config.throughput_rounds, config.throughput_streams, config.throughput_tokens
        )
        steps.step_done()
    if config.memory_streams:
        steps.start(f"memory: {config.memory_streams:,} parked streams, traced")
        report.memory = await memory_per_request(config.memory_streams)
        steps.step_done()
    for plan in config.cells():
        steps.start(f"{plan.phase.name} x {plan.concurrency:,}: {plan.approach}")
        report.results.append(await run_cell(plan))
        steps.step_done()
    for approach, frozen in config.at_once_runs():
        floors = approach == "trio-sglang" and not frozen
        label = " (gc frozen)" if frozen else ", and its two floors" if floors else ""
        steps.start(f"{config.at_once:,} streams cancelled at once: {approach}{label}")
        burst = await run_at_once(approach, config.at_once, freeze_gc=frozen)
        if floors:
            burst.extra["trio_floor_ms"] = round(await bare_trio_burst_ms(config.at_once), 1)
            alone = (await run_at_once(ENGINE_ALONE, config.at_once)).all_stopped_ms
            # None (null in the JSON, left out of the report) if a request was never stopped.
            burst.extra["engine_floor_ms"] = None if alone is None else round(alone, 1)
        report.at_once.append(burst)
        steps.step_done()
    if config.shutdown_pending:
        steps.start(f"shutdown with {config.shutdown_pending:,} pending cleanups, and its floor")
        report.shutdown = await shutdown_time(config.shutdown_pending)
        steps.step_done()
    report.runtime_s = time.perf_counter() - started
    report.cpu_s = time.process_time() - cpu_started
    report.load_average = (load_before[0], os.getloadavg()[0])
    return report


# -- the command line ---------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError("every concurrency must be >= 1")
    return values


def _names(known: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in text.split(",") if part.strip())
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(known)}; got {text!r}")
        return names

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cancel_latency.py",
        description="Cancel latency of trio-sglang vs a first-response and a poll-then-abort "
        "worker, on the SimEngine, in real time. The default run (about 2 minutes on 2 "
        "cores) measures every phase at 1, 100 and 1,000 streams and 10,000 at once.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="CI's subset, under a minute: 1 and 100 streams, all phases, 10,000 at once "
        "for trio-sglang only, smaller overhead runs",
    )
    size.add_argument(
        "--full",
        action="store_true",
        help="the whole sweep: also 10,000 streams per phase (trio-sglang), 20 cancels per "
        "cell at least, the at-once burst with the collector frozen too",
    )
    add_file_options(parser, "results.json, latency.png and summary.md")
    parser.add_argument(
        "--plot", type=Path, metavar="PATH", help="write the PNG here instead (default DIR)"
    )
    parser.add_argument("--concurrency", type=_int_list, metavar="N,N,...")
    parser.add_argument("--phases", type=_names(list(PHASES)), metavar="NAME,...")
    parser.add_argument("--approaches", type=_names(list(APPROACHES)), metavar="NAME,...")
    parser.add_argument(
        "--baseline-max-concurrency",
        type=int,
        default=1000,
        help="run the baselines only up to this many streams (default 1000)",
    )
    parser.add_argument("--at-once", type=int, metavar="N", help="0 skips it (default 10000)")
    parser.add_argument(
        "--arrival-rate",
        type=float,
        default=1000.0,
        help="streams per second at which a wave's open streams start (default 1000)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine",
        choices=["sim", "sglang-harness", "sglang-engine"],
        default="sim",
        help="sglang-harness: the smaller sweep on the real TokenizerManager (sglang extra), "
        "beside Dynamo 1.6.1's own SGLang handler (bench-dynamo extra); sglang-engine: the "
        "same on the whole sglang.Engine on this CPU, then clients leaving SGLang's own HTTP "
        "server and trio-sglang's serve, each on such an engine",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=20,
        help="cancels per phase and approach with --engine sglang-harness or sglang-engine",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    name = "quick" if args.quick else "full" if args.full else "default"
    size = SIZES[name]
    approaches = args.approaches or tuple(APPROACHES)
    chosen: dict[str, Any] = {} if args.at_once is None else {"at_once": args.at_once}
    return Config(
        grid=tuple(
            (phase, streams)
            for phase in args.phases or PHASES
            for streams in args.concurrency or size.concurrency
        ),
        size=name,
        approaches=approaches,
        baseline_max_concurrency=args.baseline_max_concurrency,
        min_cancels=size.min_cancels,
        arrival_rate=args.arrival_rate,
        seed=args.seed,
        at_once_approaches=approaches if size.at_once_baselines else ("trio-sglang",),
        at_once_gc_frozen=size.at_once_gc_frozen,
        memory_streams=size.memory_streams,
        throughput_rounds=size.throughput_rounds,
        throughput_tokens=size.throughput_tokens,
        **chosen,
    )


class _LogCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.levelname}: {record.msg}"] += 1


@contextmanager
def counting_worker_log() -> Iterator[Counter[str]]:
    """The worker's log records, counted by level and message template instead of printed.

    A burst of 10,000 cancels can make the worker log one warning per request;
    printed, they would drown the table (and the printing would slow the run).
    """
    counter = _LogCounter()
    worker_log = logging.getLogger("trio_sglang")
    worker_log.addHandler(counter)
    worker_log.propagate = False
    try:
        yield counter.counts
    finally:
        worker_log.removeHandler(counter)
        worker_log.propagate = True


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.engine in ("sglang-harness", "sglang-engine"):
        return harness_main(args)
    config = config_from_args(args)
    plot_error = _plot_error()  # known now, not after the run
    if plot_error and args.plot is not None:
        print(f"cancel_latency.py: error: {plot_error}", file=sys.stderr)
        return 2
    folder = results_folder(args.out)
    progress = Progress(config.steps() + 1)
    with counting_worker_log() as counts:
        report = trio.run(run_benchmark, config, progress)
    report.worker_log = dict(counts)
    progress.start(f"writing {folder}")
    written = save_results(report, folder, args.json, None if plot_error else args.plot)
    progress.step_done()
    progress.finish()
    print(report.format())
    print("\nfiles:")
    for path in written:
        print(f"  {path}")
    if plot_error:
        print(f"  no latency.png: {plot_error}")
    return 0


def _plot_error() -> str:
    """Why there can be no PNG, or "" if there can."""
    from trio_sglang.bench_endpoint._figures import MissingPlotDependency, pyplot

    try:
        pyplot()
    except MissingPlotDependency as exc:
        return str(exc)
    return ""


def save_results(
    report: Report, folder: Path, json_path: Path | None = None, plot_path: Path | None = None
) -> list[Path]:
    """results.json, latency.png (when ``plot_path`` or matplotlib is there) and summary.md."""
    about = machine()
    written = [json_path or folder / "results.json"]
    write_json(written[0], report.to_json(about))
    if plot_path is not None or not _plot_error():
        from _plot import plot

        written.append(plot_path or folder / "latency.png")
        plot(report.cells, written[-1])
    written.append(folder / "summary.md")
    written[-1].write_text(summary_markdown(report, about, folder.name))
    return written


def harness_main(args: argparse.Namespace) -> int:
    """The sweeps on the real SGLang: its TokenizerManager (``sglang-harness``), or the whole
    engine on the CPU (``sglang-engine``), where the model check gives way to the servers'."""
    real = args.engine == "sglang-engine"
    if importlib.util.find_spec("sglang") is None:
        print(
            f"cancel_latency.py: error: --engine {args.engine} needs SGLang "
            "(the environment `nox -s sglang` or `nox -s real-engine` builds)",
            file=sys.stderr,
        )
        return 2
    from _harness_sweep import check_model, format_harness, run_harness_sweep, run_model_sweep

    repeats = 5 if args.quick else args.repeats
    callers: tuple[Caller, ...] = ("trio-sglang", "dynamo-1.6")
    if importlib.util.find_spec("dynamo") is None:
        callers = ("trio-sglang",)
        print(
            "no dynamo-1.6: Dynamo 1.6.1 is not installed (pip install -e '.[bench-dynamo]' and "
            "pip install --no-deps ai-dynamo==1.6.1, or `nox -s sglang`)",
            file=sys.stderr,
        )
    load_before, started, cpu_started = os.getloadavg()[0], time.perf_counter(), _cpu_seconds()
    rows = trio.run(partial(run_harness_sweep, repeats, callers, real_engine=real))
    # The host and its scheduler are waited for: their CPU time is in ours now.
    own_load = (_cpu_seconds() - cpu_started) / (time.perf_counter() - started)
    load_after = os.getloadavg()[0]
    servers: list[dict[str, Any]] = []
    if real:
        servers = _server_rows(repeats)
    else:
        rows += trio.run(run_model_sweep, repeats, clock=MockClock(autojump_threshold=0))
    # No stall figure: one stream at a time has no batch of cancels for a stall to delay.
    state = judge_machine(load_before, load_after, cores(), own_load, 0.0)
    checks = [] if real else check_model(rows, state)
    print(format_harness(rows, checks))
    if servers:
        from _server_sweep import format_servers

        print(f"\n{format_servers(servers)}")
    print(f"\n{state.head}")
    if args.json is not None:
        loads = {"before": load_before, "after": load_after, "ours": own_load}
        report: dict[str, Any] = {
            "results": rows,
            **({"servers": servers} if real else {"model_check": checks}),
            "machine_state": {"quiet": state.quiet, "load": round(state.load, 2), **loads},
            "versions": _versions("sglang", "ai-dynamo", "ai-dynamo-runtime"),
        }
        args.json.write_text(json.dumps({**report, "machine": machine()}, indent=2))
        print(f"JSON: {args.json}")
    return 0


def _server_rows(repeats: int) -> list[dict[str, Any]]:
    """SGLang's own HTTP server and ``serve``, each on the whole engine and the tiny model."""
    import tempfile

    from _server_sweep import run_server_sweep
    from trio_sglang_harness import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="servers-") as scratch:
        folder = Path(scratch)
        return run_server_sweep(build_tiny_model(folder / "tiny-llama"), folder, repeats)


def _versions(*distributions: str) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in distributions:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _cpu_seconds() -> float:
    """This process's CPU time and that of the children it waited for."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


if __name__ == "__main__":
    sys.exit(main())
