"""Behind Dynamo: a client leaving at the frontend, to nothing live at the worker; CPU per token.

    python benchmarks/dynamo_cancel.py [--quick] [--json PATH]

The workers, phases and targets are in docs/benchmarks.md, "Behind Dynamo".
Beside them, the SimEngine's ``abort_lost`` (trio-sglang workers) and the live
requests left after every phase count as lost and leaked. Needs the ``dynamo``
extra and Dynamo's frontend (``nox -s bench -- --dynamo`` installs both).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from _dynamo_local import Deployment
from _leaving_client import stream_then_leave
from _output import write_json
from _report_base import Column, columns_table
from _sse_client import cpu_seconds
from _stats import percentile, percentiles
from _subprocesses import Process, free_port, gauge, poll_until
from _units import ms, ratio, times
from _verdict import Target, judge_machine

HERE = Path(__file__).resolve().parent
#: The SimEngine's defaults: 50 tokens a second a stream, as a busy GPU decodes.
FIRST_TOKEN_DELAY = 0.05
TOKEN_INTERVAL = 0.02
SEQUENTIAL_P99_MS = 5.0
BURST_RATIO = 2.0
CPU_RATIO = 1.5
BURST_STREAMS, BURST_LEAVING = 128, 64
#: Polls of /live_requests stop waiting after this; a request still live then is leaked.
RELEASE_TIMEOUT = 10.0
#: Between two polls of /live_requests. Polled back to back, the probe took a core
#: of a 2-core machine, and each worker spent its loop answering it, both away
#: from the release being timed; 0.5 ms costs each reading at most that much.
POLL_INTERVAL = 0.0005
#: Idle readings per worker, timed before its phases.
PROBE_ROUND_TRIPS = 50


@dataclass
class WorkerRun:
    """One worker's figures."""

    name: str
    sequential_ms: list[float] = field(default_factory=list)
    burst_ms: list[float] = field(default_factory=list)
    #: One idle GET of /live_requests: what each reading above includes of the probe itself.
    probe_ms: list[float] = field(default_factory=list)
    cpu_us_per_token: float | None = None
    tokens_streamed: int = 0
    lost: int = 0
    leaked: int = 0

    def to_json(self) -> dict[str, Any]:
        """Every field, each list of milliseconds as its summary."""
        return {
            key: _summary(value) if key.endswith("_ms") else value
            for key, value in asdict(self).items()
        }


def _summary(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), **percentiles(values), "p90": percentile(values, 0.9)}


class Probe:
    """A worker's ``/live_requests``, read over one keep-alive connection."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.Client(timeout=5)

    def live(self) -> int:
        return int(self.client.get(self.url).text)

    def round_trips(self, count: int) -> list[float]:
        """Milliseconds of ``count`` idle readings: the workers' probes are different servers."""
        took = []
        for _ in range(count):
            sent = time.perf_counter()
            self.live()
            took.append((time.perf_counter() - sent) * 1000)
        return took

    def until(self, done: Callable[[int], bool], on_step: Callable[[int], None]) -> bool:
        """Poll every ``POLL_INTERVAL`` until ``done(live)``; ``on_step(live)`` at each reading."""

        def reading() -> bool:
            live = self.live()
            on_step(live)
            return done(live)

        return poll_until(reading, RELEASE_TIMEOUT, poll=POLL_INTERVAL) is not None

    def settle(self, run: WorkerRun) -> bool:
        """Whether nothing is live within ``RELEASE_TIMEOUT``; else ``run`` counts what leaked."""
        if self.until(lambda live: live == 0, lambda live: None):
            return True
        run.leaked += self.live()
        return False


def _machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (``/proc/stat``: all but idle and iowait)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _body(model: str, tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": "the a",
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _read_to_end(lines: Any) -> int:
    """Completion tokens of a stream read to its end (its usage event)."""
    usage = 0
    for line in lines:
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            usage = (event.get("usage") or {}).get("completion_tokens", usage)
    return int(usage)


def sequential(url: str, model: str, probe: Probe, repeats: int, run: WorkerRun) -> None:
    for _ in range(repeats):
        body = _body(model, 100_000)
        left = stream_then_leave(url, "/v1/completions", body, chunks=3, timeout=5.0)
        if probe.settle(run):
            run.sequential_ms.append((time.monotonic() - left) * 1000)


def burst(url: str, model: str, probe: Probe, run: WorkerRun) -> None:
    """Half of the streams leave at one instant; the others stay until that is measured."""
    streaming = threading.Barrier(BURST_STREAMS + 1, timeout=60)
    leave, measured = threading.Event(), threading.Event()

    def client(leaves: bool) -> None:
        body = _body(model, 100_000)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()  # held: dropping it closes the connection
            next(line for line in lines if line.startswith("data: {"))
            streaming.wait()
            (leave if leaves else measured).wait(60)

    with concurrent.futures.ThreadPoolExecutor(BURST_STREAMS) as pool:
        futures = [pool.submit(client, k % 2 == 0) for k in range(BURST_STREAMS)]
        streaming.wait()
        previous = probe.live()
        leave.set()
        left = time.perf_counter()

        def step(live: int) -> None:
            nonlocal previous
            released = max(0, previous - live)
            run.burst_ms.extend([(time.perf_counter() - left) * 1000] * released)
            previous = min(previous, live)

        staying = BURST_STREAMS - BURST_LEAVING
        if not probe.until(lambda live: live <= staying, step):
            run.leaked += probe.live() - staying
        measured.set()
        for future in futures:
            future.result()
    probe.settle(run)


def cpu_per_token(
    url: str, model: str, process: Process, streams: int, tokens: int, run: WorkerRun
) -> None:
    def client(_: int) -> int:
        with httpx.stream("POST", f"{url}/v1/completions", json=_body(model, tokens)) as stream:
            return _read_to_end(stream.iter_lines())

    before = cpu_seconds(process.pid)
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        received = sum(pool.map(client, range(streams)))
    spent = cpu_seconds(process.pid) - before
    run.tokens_streamed = received
    run.cpu_us_per_token = spent / received * 1e6 if received else None


def start_workers(deployment: Deployment) -> list[tuple[str, str, Process, int]]:
    """(name, model, process, metrics port) for each worker, all registered."""
    timing = ["--sim-first-token-delay", str(FIRST_TOKEN_DELAY)]
    timing += ["--sim-token-interval", str(TOKEN_INTERVAL)]
    started = []
    for name, model, loop in (
        ("trio-sglang (guest)", "trio-guest", "guest"),
        ("trio-sglang (trio-asyncio)", "trio-aio", "trio-asyncio"),
    ):
        port = free_port()
        command = deployment.trio_worker_command(model, port, "--loop", loop, *timing)
        started.append((name, model, deployment.start_worker(model, command, model), port))
    port = free_port()
    plain = [deployment.python, str(HERE / "_dynamo_plain_worker.py"), "--model-name", "plain"]
    plain += ["--metrics-port", str(port), "--first-token-delay", str(FIRST_TOKEN_DELAY)]
    plain += ["--token-interval", str(TOKEN_INTERVAL)]
    started.append(
        ("plain asyncio", "plain", deployment.start_worker("plain", plain, "plain"), port)
    )
    return started


def targets(runs: dict[str, WorkerRun]) -> list[Target]:
    ours, floor = runs["trio-sglang (guest)"], runs["plain asyncio"]
    seq = percentile(ours.sequential_ms, 0.99)
    ours_burst, floor_burst = percentile(ours.burst_ms, 0.99), percentile(floor.burst_ms, 0.99)
    burst_ratio = ratio(ours_burst or None, floor_burst)
    cpu_ratio = ratio(ours.cpu_us_per_token or None, floor.cpu_us_per_token)
    lost = sum(run.lost for run in runs.values())
    leaked = sum(run.leaked for run in runs.values())
    return [
        Target(
            "disconnect -> nothing live, p99, sequential",
            f"<= {SEQUENTIAL_P99_MS:g} ms",
            ms(seq),
            None if seq is None else seq <= SEQUENTIAL_P99_MS,
            "time",
        ),
        Target(
            "64 of 128 leaving at once, p99, vs the plain worker",
            f"<= {BURST_RATIO:g}x",
            times(burst_ratio, none="n/a"),
            None if burst_ratio is None else burst_ratio <= BURST_RATIO,
        ),
        Target(
            "worker CPU per streamed token, vs the plain worker",
            f"<= {CPU_RATIO:g}x",
            times(cpu_ratio, none="n/a"),
            None if cpu_ratio is None else cpu_ratio <= CPU_RATIO,
        ),
        Target(
            "lost / leaked over every run",
            "0 / 0",
            f"{lost} / {leaked}",
            lost == 0 and leaked == 0,
        ),
    ]


def _three(values: list[float]) -> str:
    stats = _summary(values)
    return " / ".join(ms(stats[key]) for key in ("p50", "p99", "max"))


#: The Markdown table printed, a row per worker.
COLUMNS: list[Column[WorkerRun]] = [
    ("worker", lambda run: run.name),
    ("sequential p50 / p99 / max", lambda run: _three(run.sequential_ms)),
    ("burst p50 / p99 / max", lambda run: _three(run.burst_ms)),
    (
        "CPU per token",
        lambda run: "n/a" if (us := run.cpu_us_per_token) is None else f"{us:.0f} µs",
    ),
    ("lost / leaked", lambda run: f"{run.lost} / {run.leaked}"),
    ("probe p50", lambda run: ms(percentile(run.probe_ms, 0.5))),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI's size: about a minute")
    parser.add_argument("--repeats", type=int, help="sequential leaves per worker (30; quick 8)")
    parser.add_argument("--bursts", type=int, help="bursts per worker (3; quick 1)")
    parser.add_argument("--streams", type=int, default=32, help="streams of the CPU phase")
    parser.add_argument("--tokens", type=int, help="tokens per stream there (200; quick 100)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    repeats = args.repeats or (8 if args.quick else 30)
    bursts = args.bursts or (1 if args.quick else 3)
    tokens = args.tokens or (100 if args.quick else 200)

    load_before = os.getloadavg()[0]
    busy_before = _machine_busy_seconds()
    started_at, cpu_at = time.perf_counter(), time.process_time()
    runs: dict[str, WorkerRun] = {}
    children_cpu = 0.0
    with tempfile.TemporaryDirectory() as folder, Deployment(Path(folder)) as deployment:
        url = deployment.start_frontend()
        workers = start_workers(deployment)
        print(f"frontend {url}; workers: {', '.join(w[0] for w in workers)}", file=sys.stderr)
        for name, model, process, port in workers:
            run = runs[name] = WorkerRun(name)
            probe = Probe(f"http://127.0.0.1:{port}/live_requests")
            run.probe_ms = probe.round_trips(PROBE_ROUND_TRIPS)
            print(f"{name}: {repeats} sequential leaves", file=sys.stderr)
            sequential(url, model, probe, repeats, run)
            for k in range(bursts):
                print(f"{name}: burst {k + 1} of {bursts}", file=sys.stderr)
                burst(url, model, probe, run)
            print(f"{name}: {args.streams} streams x {tokens} tokens", file=sys.stderr)
            cpu_per_token(url, model, process, args.streams, tokens, run)
            if not name.startswith("plain"):
                lost = 'trio_sglang_sim_events_total{kind="abort_lost"}'
                run.lost = int(gauge(f"http://127.0.0.1:{port}", lost, default=0))
            run.leaked += probe.live()
        for process in deployment.processes:
            children_cpu += cpu_seconds(process.pid)
    wall = time.perf_counter() - started_at
    own = (time.process_time() - cpu_at + children_cpu) / wall
    # Ours are many processes and threads, so the load average after the run
    # is mostly ours, and more than our CPU share says. Others' part is read
    # instead as the machine's busy CPU less ours, in cores.
    others = max(0.0, (_machine_busy_seconds() - busy_before) / wall - own)
    machine = judge_machine(load_before, own + others, os.cpu_count() or 1, own, 0.0)
    verdicts = [target.judged_on(machine) for target in targets(runs)]
    print("\n".join(columns_table(COLUMNS, runs.values(), markdown=True)))
    print(machine.line())
    for target in verdicts:
        print(target.line())
    if args.json is not None:
        record = {
            "timing": {"first_token_delay": FIRST_TOKEN_DELAY, "token_interval": TOKEN_INTERVAL},
            "machine": machine.to_json(),
            "workers": [run.to_json() for run in runs.values()],
            "targets": [target.to_json() for target in verdicts],
        }
        write_json(args.json, record)
    return 0 if verdicts[-1].met else 1  # lost or leaked: a fault, not a figure


if __name__ == "__main__":
    sys.exit(main())
