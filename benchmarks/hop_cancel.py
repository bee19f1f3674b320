"""Cancel-to-free latency across a hop: bench-endpoint through Dynamo's frontend in cluster
mode and through a router, beside the same worker reached directly.

The setups and the method are in docs/benchmarks.md, "Across a hop: Dynamo in
cluster mode, smg and sglang-router": one SimEngine worker each, so that only
the hop differs, run one after another. ``router_cancel.py`` runs its own
clients through ``behind_router`` and ``bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from _cluster_daemons import PLANES, Daemons, cluster_env, open_daemons
from _dynamo_local import Deployment
from _output import table, write_json
from _serve_processes import start_router, start_workers
from _subprocesses import free_port
from _units import ratio, times
from trio_sglang.bench_endpoint._departures import ALL_PHASES
from trio_sglang.bench_endpoint._report import Report, load, percentile

#: bench-endpoint's ways of leaving (``stay`` is no leave).
LEAVING = [phase.name for phase in ALL_PHASES if phase.leave != "stay"]
#: The routers, in the order they run.
ROUTED = ("smg", "sglang-router")
#: How long one bench-endpoint run may take, at most.
RUN_TIMEOUT = 900.0


@dataclass(frozen=True, slots=True)
class Setup:
    """Where bench-endpoint sends its clients, and the workers whose gauges it reads."""

    name: str
    url: str
    metrics: list[str]
    model: str | None = None


@contextlib.contextmanager
def direct(log_dir: Path) -> Iterator[Setup]:
    ((worker, url),) = start_workers(["direct"], log_dir)
    try:
        yield Setup("direct", url, [f"{url}/metrics"])
    finally:
        worker.stop()


@contextlib.contextmanager
def behind_router(log_dir: Path, router: str, *worker_args: str) -> Iterator[tuple[Setup, Setup]]:
    """A worker (``serve WORKER_ARGS``) behind ``router``: the setup through the router, and
    the same worker reached directly, so that a run beside it differs only by the hop."""
    ((worker, worker_url),) = start_workers([f"{router}-worker"], log_dir, *worker_args)
    processes = [worker]
    metrics = [f"{worker_url}/metrics"]
    try:
        args = ("--log-level", "warn")
        process, url = start_router(log_dir, [worker_url], *args, watched=[worker], router=router)
        processes.append(process)
        yield Setup(router, url, metrics), Setup("direct", worker_url, metrics)
    finally:
        for process in reversed(processes):
            process.stop()


@contextlib.contextmanager
def behind_dynamo(log_dir: Path, daemons: Daemons, planes: tuple[str, str]) -> Iterator[Setup]:
    """The frontend and a worker of a model named after the planes (etcd is shared)."""
    folder = log_dir / "-".join(planes)
    folder.mkdir()
    model = f"sim-{'-'.join(planes)}"
    with Deployment(folder, env=cluster_env(daemons, *planes)) as deployment:
        url = deployment.start_frontend(beside=daemons.processes())
        port = free_port()
        deployment.start_worker("worker", deployment.trio_worker_command(model, port), model)
        yield Setup(f"dynamo {'/'.join(planes)}", url, [f"http://127.0.0.1:{port}/metrics"], model)


#: How this benchmark's clients leave: in every way, 8 at once, on the completions route.
EVERY_WAY = ("--api", "openai-completions", "--phases", *LEAVING, "--concurrency", "8")


def bench(setup: Setup, out: Path, clients: int, leaving: Sequence[str] = EVERY_WAY) -> Report:
    """One bench-endpoint run against ``setup``, ``clients`` per phase, ``leaving`` the
    options that say how they leave; its report."""
    command = [sys.executable, "-m", "trio_sglang", "bench-endpoint", "--url", setup.url]
    command += [*leaving, "--requests", str(clients), "--json", str(out)]
    command += [arg for url in setup.metrics for arg in ("--metrics-url", url)]
    if setup.model is not None:
        command += ["--model", setup.model]
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench-endpoint against {setup.name} failed:\n{done.stderr[-3000:]}")
    return load(out)


def run(clients: int, planes: Sequence[tuple[str, str]], work: Path) -> dict[str, Report]:
    """Every setup in turn, each stopped before the next starts; their reports by name."""
    reports: dict[str, Report] = {}

    def measure(setup: Setup) -> None:
        started = time.monotonic()
        reports[setup.name] = bench(setup, work / f"{len(reports)}.json", clients)
        print(f"{setup.name}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    with direct(work) as setup:
        measure(setup)
    for router in ROUTED:
        with behind_router(work, router) as (setup, _):
            measure(setup)
    (work / "daemons").mkdir()
    with open_daemons(work / "daemons") as daemons:
        for pair in planes:
            with behind_dynamo(work, daemons, pair) as setup:
                measure(setup)
    return reports


#: The ways of leaving the table shows apart: FIN and reset together.
LEAVES = ("before_headers", "before_first_token", "first_token", "mid_stream")


def releases(report: Report, leave: str | None = None) -> list[float]:
    """Every release of ``report`` (of clients that left in ``leave``, if given), sorted."""
    phases = [p for p in report.phases if leave is None or p.name.startswith(f"{leave}:")]
    return sorted(ms for phase in phases for ms in phase.release_ms)


def _p50_p99(values: list[float]) -> str:
    p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
    return "-" if p50 is None or p99 is None else f"{p50:.1f} / {p99:.1f}"


def format_reports(reports: dict[str, Report]) -> str:
    """Two tables within ``WIDTH``: every leave against the direct worker's, then each way."""
    base = releases(reports["direct"])
    base_p50, base_p99 = percentile(base, 0.5), percentile(base, 0.99)
    summary, ways = [], []
    for name, report in reports.items():
        every = releases(report)
        leaked = sum(phase.leaked for phase in report.phases)
        failed = sum(phase.failed for phase in report.phases)
        summary.append(
            (
                name,
                str(sum(phase.left for phase in report.phases)),
                _p50_p99(every),
                f"{every[-1]:.1f}" if every else "-",
                f"{leaked} / {failed}",
                times(ratio(percentile(every, 0.5), base_p50)),
                times(ratio(percentile(every, 0.99), base_p99)),
            )
        )
        ways.append((name, *(_p50_p99(releases(report, leave)) for leave in LEAVES)))
    lines = [
        "client leaves -> its worker's engine holds nothing, ms (p50 / p99; FIN and reset);",
        "vs direct: the ratio to the direct worker's, from this run",
        *table(
            ("setup", "left", "p50 / p99", "max", "leaked / failed", "p50 vs", "p99 vs"),
            summary,
        ),
        "",
        "by the way the client left, ms (p50 / p99):",
        *table(("setup", "before headers", "before 1st token", "at 1st token", "mid-stream"), ways),
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--clients", type=int, default=64, help="clients per way of leaving (default 64)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="8 clients per way, two plane combinations"
    )
    parser.add_argument("--json", type=Path, help="write every setup's figures here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    clients = 8 if args.quick else args.clients
    if clients < 1:
        raise SystemExit("--clients must be at least 1")
    planes = [PLANES[0], PLANES[-1]] if args.quick else PLANES
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hop-cancel-") as work:
        reports = run(clients, planes, Path(work))
    print(format_reports(reports))
    print(f"runtime {time.monotonic() - started:.0f} s")
    if args.json is not None:
        data = {
            name: {
                "left": sum(p.left for p in r.phases),
                "release_ms": {leave: releases(r, leave) for leave in LEAVES},
                "leaked": sum(p.leaked for p in r.phases),
            }
            for name, r in reports.items()
        }
        write_json(args.json, {"clients_per_way": clients, "setups": data})
        print(f"wrote {args.json}")
    leaked = sum(phase.leaked for report in reports.values() for phase in report.phases)
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
