"""Serving throughput: ``trio-sglang serve``'s CPU per streamed chunk, against the stack's floor.

    python benchmarks/serve_throughput.py [--quick] [--streams 10 100 1000] [--rate 5000]
        [--max-tokens 128] [--endpoint /v1/chat/completions] [--rounds 2]
        [--warmup 1.5] [--window 4] [--out DIR] [--json PATH]

What runs (``serve``, the floor ``_sse_floor.py``, the client ``_sse_client.py``),
the offered load and what is judged: docs/benchmarks.md, "Serving throughput".
The offered load is the same at every stream count (``rate`` tokens a second in
all), so that each row measures the same work spread over more streams. The exit
status is 1 if a check on the run's validity failed (a request failed, a cell
read nothing, the clients used too much CPU); the targets are reported, not
required.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import trio

from _load_server import ServerProcess, open_server
from _output import Progress, add_file_options, cores, number, results_folder
from _sse_client import Reading, reading_from
from _throughput_report import SERVERS, Cell, Server, ThroughputReport
from trio_sglang._cli._field_options import positive_int
from trio_sglang.bench_endpoint._apis import request_body

__all__ = ["FULL", "QUICK", "Config", "build_parser", "main", "record_events", "run_benchmark"]

HERE = Path(__file__).resolve().parent
CLIENT = HERE / "_sse_client.py"
FLOOR = HERE / "_sse_floor.py"
SGLANG = HERE / "_sglang_http.py"
#: The floor's events, in the run's scratch folder.
EVENTS = "events.json"
#: Seconds between two tokens of the response the floor's events are recorded from.
RECORD_INTERVAL = 0.01


@dataclass(frozen=True, slots=True)
class Config:
    """Seconds throughout; ``rate`` in tokens per second, offered in all."""

    streams: tuple[int, ...] = (10, 100, 1000)
    rate: float = 5000.0
    max_tokens: int = 128
    endpoint: str = "/v1/chat/completions"
    rounds: int = 2
    warmup: float = 1.5
    window: float = 4.0
    #: The warm-up goes on until every stream has had a token, at most this much longer.
    flowing_bound: float = 30.0
    #: The client's pause between two rounds of reads (its CPU per chunk, not the server's).
    read_pause: float = 0.002
    start_timeout: float = 30.0
    http_timeout: float = 10.0
    settle_timeout: float = 10.0
    stop_timeout: float = 10.0
    #: Also SGLang's own HTTP server (``_sglang_http.py``); it takes longer to start.
    sglang: bool = False
    #: Also ``serve`` hosting SGLang's application (``serve --engine sglang``'s way) over
    #: the same TokenizerManager and stand-in scheduler as SGLang's own server.
    hosted: bool = False
    #: Where the hosted server runs SGLang's asyncio code (``serve --loop``).
    hosted_loop: str = "guest"
    sglang_start_timeout: float = 180.0

    @property
    def servers(self) -> tuple[Server, ...]:
        more: list[Server] = []
        if self.sglang:
            more.append("sglang")
        if self.hosted:
            more.append("hosted")
        return (*SERVERS, *more)

    def interval(self, streams: int) -> float:
        return streams / self.rate

    def serve_args(self, streams: int) -> list[str]:
        """The SimEngine's timing: a token every interval, the first one interval in."""
        interval = f"{self.interval(streams):g}"
        return [
            *("--sim-tokenize-delay", "0", "--sim-dispatch-delay", "0"),
            *("--sim-first-token-delay", interval, "--sim-token-interval", interval),
        ]

    def launch(
        self, name: Server, streams: int, scratch: Path
    ) -> tuple[list[str], list[str] | None, float]:
        """How ``name`` is started: its arguments, its command (None: ``serve``) and its start
        bound. The floor and the stand-in scheduler pace as the SimEngine does in ``serve``."""
        interval = f"{self.interval(streams):g}"
        pace = ["--first-token-delay", interval, "--token-interval", interval]
        if name == "serve":
            return self.serve_args(streams), None, self.start_timeout
        if name == "floor":
            command = [sys.executable, str(FLOOR), "--port", "0"]
            return ["--events", str(scratch / EVENTS), *pace], command, self.start_timeout
        workdir = scratch / f"{name}-{streams}"
        workdir.mkdir()
        return (
            ["--workdir", str(workdir), *pace, *("--server", name, "--loop", self.hosted_loop)],
            [sys.executable, str(SGLANG)],
            self.sglang_start_timeout,
        )


FULL = Config()
QUICK = Config(rounds=1, warmup=1.0, window=1.5)


async def record_events(config: Config, tries: int = 5) -> list[str]:
    """One ``max_tokens`` response of ``serve``'s, as its events (``[DONE]`` left out).

    From a ``serve`` of its own, a token every ``RECORD_INTERVAL``: one slow
    enough that the server is never late for a token, even on a busy machine
    (a server late for a token sends the backlog as one event, and the floor
    needs one event per token). Should one come coalesced all the same, the
    next try is taken.
    """
    interval = f"{RECORD_INTERVAL:g}"
    args = ["--sim-first-token-delay", interval, "--sim-token-interval", interval]
    async with open_server(
        args, start_timeout=config.start_timeout, http_timeout=config.http_timeout
    ) as server:
        model = await server.model()
        body = request_body(config.endpoint, "hello", config.max_tokens, model=model)
        for _ in range(tries):
            async with server.admin.stream("POST", config.endpoint, json=body) as response:
                response.raise_for_status()
                raw = b"".join([part async for part in response.aiter_raw()]).decode()
            # Data events only: a heartbeat (an SSE comment) may come before the first token.
            events = [f"{event}\n\n" for event in raw.split("\n\n") if event.startswith("data:")]
            if events[-1:] != ["data: [DONE]\n\n"]:
                raise RuntimeError(f"a stream that did not end with [DONE]: {raw[-200:]!r}")
            if len(events) == config.max_tokens + 1:
                await server.stop(config.stop_timeout)
                return events[:-1]
    raise RuntimeError(f"no response of {config.max_tokens} single-token events in {tries} tries")


async def read_streams(server: ServerProcess, streams: int, config: Config) -> Reading:
    """Run the client process against ``server``: its ``Reading`` of one window."""
    command = [
        sys.executable,
        str(CLIENT),
        *("--url", server.url, "--endpoint", config.endpoint),
        *("--streams", str(streams), "--max-tokens", str(config.max_tokens)),
        *("--warmup", f"{config.warmup:g}", "--window", f"{config.window:g}"),
        *("--flowing-bound", f"{config.flowing_bound:g}", "--read-pause", f"{config.read_pause:g}"),
        *("--server-pid", str(server.process.pid)),
    ]
    with trio.fail_after(
        config.warmup + config.flowing_bound + config.window + config.start_timeout
    ):
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
    return reading_from(done.stdout.decode().strip().splitlines()[-1])


@asynccontextmanager
async def _servers(
    config: Config, streams: int, scratch: Path, progress: Progress
) -> AsyncIterator[dict[str, ServerProcess]]:
    """The servers at this stream count's interval, all up; stopped after."""
    progress.start(f"{streams:,} streams: starting {', '.join(config.servers)}")
    async with AsyncExitStack() as stack:
        servers: dict[str, ServerProcess] = {}
        for name in config.servers:
            args, command, start_timeout = config.launch(name, streams, scratch)
            servers[name] = await stack.enter_async_context(
                open_server(
                    args,
                    start_timeout=start_timeout,
                    http_timeout=config.http_timeout,
                    command=command,
                )
            )
        progress.step_done()
        yield servers
        for server in servers.values():
            await server.stop(config.stop_timeout)


async def run_benchmark(config: Config, progress: Progress) -> ThroughputReport:
    report = ThroughputReport(
        config={**asdict(config), "streams": list(config.streams)},
        cores=cores(),
        intervals={streams: config.interval(streams) for streams in config.streams},
    )
    load_before = os.getloadavg()[0]
    started, children_before = time.perf_counter(), _own_cpu()
    with tempfile.TemporaryDirectory(prefix="serve-throughput-") as scratch:
        progress.start("recording serve's events for the floor")
        (Path(scratch) / EVENTS).write_text(json.dumps(await record_events(config)))
        progress.step_done()
        for streams in sorted(config.streams):
            async with _servers(config, streams, Path(scratch), progress) as servers:
                for round_ in range(config.rounds):
                    for name in config.servers:
                        progress.start(
                            f"{streams:,} streams, round {round_ + 1}/{config.rounds}: {name}"
                        )
                        reading = await read_streams(servers[name], streams, config)
                        report.cells.append(Cell(name, streams, round_, reading))
                        if name in ("serve", "hosted"):  # the streams' cleanup is over
                            await servers[name].settle(config.settle_timeout)
                        progress.step_done()
    report.runtime_s = time.perf_counter() - started
    report.own_cpu_s = _own_cpu() - children_before
    report.load_average = (load_before, os.getloadavg()[0])
    return report


def _own_cpu() -> float:
    """This process's CPU seconds and its reaped children's (the servers, the clients)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def progress_steps(config: Config) -> int:
    return 1 + len(config.streams) * (1 + config.rounds * len(config.servers))


# -- the command line ---------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="serve_throughput.py",
        description="trio-sglang serve's CPU per streamed chunk and chunks/s, against a "
        "minimal ASGI app on the same hypercorn streaming the same bytes, in the same run.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help=f"CI's run: {QUICK.rounds} round of {QUICK.window:g} s per cell (under a minute)",
    )
    size.add_argument(
        "--full",
        action="store_true",
        help=f"the default size, {FULL.rounds} rounds of {FULL.window:g} s per cell (for nox "
        "-s bench -- --full)",
    )
    parser.add_argument("--streams", type=positive_int, nargs="+", help="default 10 100 1000")
    parser.add_argument(
        "--rate",
        type=number(float, 0, above=True),
        help=f"tokens/s offered in all (default {FULL.rate:g})",
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, help=f"per request (default {FULL.max_tokens})"
    )
    parser.add_argument(
        "--endpoint",
        choices=("/v1/chat/completions", "/v1/completions", "/generate"),
        help=f"default {FULL.endpoint}",
    )
    parser.add_argument("--rounds", type=positive_int, help=f"default {FULL.rounds}")
    parser.add_argument(
        "--warmup", type=number(float, 0, above=True), help=f"s (default {FULL.warmup:g})"
    )
    parser.add_argument(
        "--window", type=number(float, 0, above=True), help=f"s (default {FULL.window:g})"
    )
    parser.add_argument(
        "--sglang",
        action="store_true",
        help="also SGLang's own HTTP server, on the GPU-free harness's stand-in scheduler "
        "(needs the sglang extra, soundfile and python-multipart; see _sglang_http.py)",
    )
    parser.add_argument(
        "--hosted",
        action="store_true",
        help="also serve hosting SGLang's application (serve --engine sglang's way) over the "
        "same TokenizerManager and stand-in scheduler (needs what --sglang needs)",
    )
    parser.add_argument(
        "--hosted-loop",
        choices=["guest", "trio-asyncio"],
        help="where --hosted runs SGLang's asyncio code, as serve --loop (default guest)",
    )
    add_file_options(parser, "serve_throughput.json and its section of summary.md")
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    config = QUICK if args.quick else FULL
    chosen = {
        name: getattr(args, name)
        for name in (
            *("rate", "max_tokens", "endpoint", "rounds", "warmup", "window", "sglang", "hosted"),
            "hosted_loop",
        )
        if getattr(args, name) is not None
    }
    if args.streams:
        chosen["streams"] = tuple(args.streams)
    return replace(config, **chosen)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    folder = results_folder(args.out)
    progress = Progress(progress_steps(config))
    report = trio.run(run_benchmark, config, progress)
    progress.finish()
    print(report.format())
    print("\nfiles:")
    for path in report.save(folder, args.json, "serve_throughput.json"):
        print(f"  {path}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
