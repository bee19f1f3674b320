"""SGLang's ``bench_serving`` against SGLang's server and ``serve --engine sglang``, taking turns.

    python benchmarks/sglang_bench_serving.py [--concurrency 16 64] [--rounds 3]
        [--prompts 300] [--loops guest trio-asyncio] [--model-path DIR]

The method is in docs/benchmarks.md, "``serve --engine sglang`` beside
SGLang's own server, on the whole engine". Every server is up for the whole
run and they take turns, so that each round compares servers on the same
machine at the same moment; each ratio is against SGLang's server in the same
round. Run it in ``nox -s real-engine``'s environment (which builds the tiny
model). Prints a row per run, then the median ratios per concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from _sse_client import cpu_seconds
from _subprocesses import Process, free_ports, healthy, wait_until

HERE = Path(__file__).resolve().parent
SERVERS_CPU = HERE / "_http_servers_cpu.py"
DEFAULT_MODEL = HERE.parent / ".nox" / "real-engine" / "tiny-llama"
#: Seconds a server may take to load the model and warm up.
START_TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class Run:
    """One ``bench_serving`` run against one server."""

    concurrency: int
    round: int
    server: str
    completed: int
    output_throughput: float  # tokens/s
    ttft_p99_ms: float
    itl_p50_ms: float
    #: The server process's CPU over the run, per output token.
    cpu_us_per_token: float


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument(
        "--loops", nargs="+", choices=["guest", "trio-asyncio"], default=["guest", "trio-asyncio"]
    )
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL)
    args = parser.parse_args(argv)
    if not (args.model_path / "config.json").exists():
        parser.error(f"no model at {args.model_path}: run `nox -s real-engine --install-only`")
    servers = {"sglang": ["sglang", "--"]}
    for loop in args.loops:
        servers[f"serve {loop}"] = ["trio-sglang", "--", "--loop", loop]
    with (
        tempfile.TemporaryDirectory() as scratch,
        running(servers, args.model_path, Path(scratch)) as processes,
    ):
        runs: list[Run] = []
        for concurrency in args.concurrency:
            for round_ in range(1, args.rounds + 1):
                for name, (url, pid) in processes.items():
                    out = Path(scratch) / f"{concurrency}-{round_}-{len(runs)}.jsonl"
                    run = bench(name, url, pid, args, concurrency, round_, out)
                    runs.append(run)
                    print(_row(run), flush=True)
    print()
    for line in _summary(runs, args.concurrency, list(processes)):
        print(line)
    return 0


@contextmanager
def running(
    servers: dict[str, list[str]], model: Path, folder: Path
) -> Iterator[dict[str, tuple[str, int]]]:
    """Every server up at once, each on its own port; their URLs and process ids."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    ports = free_ports(len(servers))
    with ExitStack() as stack:
        started: dict[str, tuple[str, Process]] = {}
        for (name, args), port in zip(servers.items(), ports, strict=True):
            command = [sys.executable, str(SERVERS_CPU), *args]
            command += ["--model-path", str(model), "--port", str(port)]
            log = folder / f"{name.replace(' ', '-')}.log"
            process = Process(name, command, log, env)
            stack.callback(process.stop, 30)
            started[name] = (f"http://127.0.0.1:{port}", process)
        processes = [process for _, process in started.values()]
        for name, (url, _) in started.items():
            up = partial(healthy, url)
            wait_until(f"{name} to answer /health", up, START_TIMEOUT, *processes)
            print(f"{name} up at {url}", flush=True)
        yield {name: (url, process.pid) for name, (url, process) in started.items()}


def bench(
    name: str,
    url: str,
    pid: int,
    args: argparse.Namespace,
    concurrency: int,
    round_: int,
    out: Path,
) -> Run:
    command = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
        "--model", str(args.model_path), "--tokenizer", str(args.model_path),
        "--dataset-name", "random-ids", "--random-input-len", "64", "--random-output-len", "64",
        "--random-range-ratio", "1", "--num-prompts", str(args.prompts),
        "--max-concurrency", str(concurrency), "--disable-tqdm", "--output-file", str(out),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cpu_before = cpu_seconds(pid)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    cpu = cpu_seconds(pid) - cpu_before
    if done.returncode != 0:
        raise SystemExit(f"bench_serving against {name} failed:\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text().splitlines()[-1])
    tokens = max(int(result["total_output_tokens"]), 1)
    return Run(
        concurrency,
        round_,
        name,
        int(result["completed"]),
        float(result["output_throughput"]),
        float(result["p99_ttft_ms"]),
        float(result["median_itl_ms"]),
        cpu / tokens * 1e6,
    )


def _row(run: Run) -> str:
    return (
        f"concurrency {run.concurrency} round {run.round} {run.server:>18}: "
        f"{run.completed} done, {run.output_throughput:,.1f} tok/s, "
        f"TTFT p99 {run.ttft_p99_ms:,.0f} ms, ITL p50 {run.itl_p50_ms:.2f} ms, "
        f"CPU {run.cpu_us_per_token:.0f} us/token"
    )


def _summary(runs: list[Run], concurrencies: list[int], names: list[str]) -> Iterator[str]:
    """Per concurrency and server: the median, over rounds, of its ratios to SGLang's server."""
    yield (
        "median over rounds, against SGLang's server in the same round "
        "(tok/s, TTFT p99, front-end CPU per token):"
    )
    by = {(r.concurrency, r.round, r.server): r for r in runs}
    for concurrency in concurrencies:
        rounds = sorted({r.round for r in runs if r.concurrency == concurrency})
        for name in names[1:]:
            pairs = [(by[concurrency, i, name], by[concurrency, i, names[0]]) for i in rounds]
            speed = statistics.median(
                ours.output_throughput / theirs.output_throughput for ours, theirs in pairs
            )
            ttft = statistics.median(
                ours.ttft_p99_ms / theirs.ttft_p99_ms for ours, theirs in pairs
            )
            cpu = statistics.median(
                ours.cpu_us_per_token / theirs.cpu_us_per_token for ours, theirs in pairs
            )
            yield f"  concurrency {concurrency} {name:>18}: {speed:.2f}x, {ttft:.2f}x, {cpu:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
