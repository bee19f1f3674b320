"""Behind sglang-router: from a streaming client leaving to the worker letting go.

    python benchmarks/router_cancel.py [--quick] [--repeat 5] [--first-token-delay 5]
        [--token-gap 2] [--heartbeat 0.1] [--dwell 0.5] [--seed 0] [--json PATH]

sglang-router sends a worker no abort when its client leaves: once it has
answered a stream, it notices only when it next writes to the client, then
drops its connection to the worker, which cancels the request at once. So
without heartbeats a client that leaves before the first token holds the
worker until that token, and one that leaves in a gap until the next token;
with ``--sse-heartbeat`` the worker writes an SSE comment into every silence
of that length, and the router notices at the next one.

Runs as a user runs it, on loopback: ``trio-sglang serve`` workers on the
SimEngine (``python -m trio_sglang serve``), each behind its own
``python -m sglang_router.launch_router``, one pair per timing and heartbeat
setting: a worker whose first token comes ``--first-token-delay`` after the
request (the client leaves before it), and one with ``--token-gap`` between
tokens (the client leaves in the gap after the first). A client is a raw
socket: it sends a streaming ``/generate``, reads until the headers (or the
first token), stays ``--dwell`` seconds plus a random share of a heartbeat
interval, reads what has come, and closes (a FIN). The time measured runs
from that close until the worker's ``/metrics`` says its engine holds
nothing (``trio_sglang_engine_live_requests``, polled), through the router
and, as the reference, to the worker directly. Each trial waits for the
worker to be idle first; every wait is bounded. The table on stdout,
progress on stderr, every trial in ``--json PATH``; exit status 1 if a
trial did not end (the worker never let go within its bound).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _leaving_client import drain, post_raw, read_until
from _output import table, write_json
from _serve_processes import start_router, start_workers
from _subprocesses import gauge, poll_until

__all__ = ["Config", "Trial", "main", "run_benchmark"]

#: A socket read, a scrape.
IO_TIMEOUT = 10.0
#: Tokens a request asks for: it never ends on its own within a trial.
LONG = 10_000
PHASES = ("before_first_token", "mid_stream")
VIAS = ("router", "direct")


@dataclass(frozen=True, slots=True)
class Config:
    repeat: int = 5
    #: Seconds from a request to its first token on the before-the-first-token worker.
    first_token_delay: float = 5.0
    #: Seconds between two tokens on the mid-stream worker.
    token_gap: float = 2.0
    #: ``--sse-heartbeat`` of the workers with heartbeats on.
    heartbeat: float = 0.1
    #: How long a client stays after the headers (or the first token) before it leaves,
    #: plus a random share of a heartbeat interval (so that it leaves at any moment of one).
    dwell: float = 0.5
    seed: int = 0


QUICK = Config(repeat=2, first_token_delay=2.0, token_gap=1.0)


@dataclass(slots=True)
class Trial:
    heartbeat: float
    via: str
    phase: str
    #: Seconds from the client's close to the worker holding nothing; None: never, within the bound.
    let_go: float | None


# -- processes ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    heartbeat: float
    phase: str
    worker: str
    router: str


def start_setups(stack: contextlib.ExitStack, log_dir: Path, config: Config) -> list[Setup]:
    """A worker behind a router of its own per heartbeat setting and phase, stopped with
    ``stack`` (each router before its worker)."""
    timing = {
        "before_first_token": ("--sim-first-token-delay", str(config.first_token_delay)),
        "mid_stream": ("--sim-token-interval", str(config.token_gap)),
    }
    setups = []
    for heartbeat in (config.heartbeat, 0.0):
        for phase in PHASES:
            name = f"{phase}-{heartbeat:g}"
            folder = log_dir / name  # a router logs to its own name: one folder per setup
            folder.mkdir()
            args = (*timing[phase], "--sse-heartbeat", str(heartbeat))
            ((worker, url),) = start_workers([f"worker-{name}"], folder, *args)
            stack.callback(worker.stop)
            router_args = ("--policy", "round_robin", "--log-level", "warn")
            router, router_url = start_router(folder, [url], *router_args, watched=[worker])
            stack.callback(router.stop)
            setups.append(Setup(heartbeat, phase, url, router_url))
    return setups


# -- one trial --------------------------------------------------------------------------------


def live(worker: str) -> float:
    """``trio_sglang_engine_live_requests`` from the worker's ``/metrics``."""
    return gauge(worker, "trio_sglang_engine_live_requests", timeout=IO_TIMEOUT)


def wait_idle(worker: str, timeout: float) -> float | None:
    """Poll until the worker's engine holds nothing; the seconds it took (None: not in time)."""
    return poll_until(lambda: live(worker) == 0, timeout, poll=0.002)


def stream(url: str) -> socket.socket:
    """A streaming ``/generate`` over a socket of its own."""
    body = {"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": LONG}}
    return post_raw(url, "/generate", body, IO_TIMEOUT)


def trial(url: str, worker: str, phase: str, dwell: float, bound: float) -> float | None:
    """One client through ``url`` to ``worker``: it leaves in ``phase``, ``dwell`` s after the
    headers (or the first token); the seconds until the worker let go."""
    if wait_idle(worker, bound) is None:
        raise RuntimeError(f"{worker} still holds a request from an earlier trial")
    sock = stream(url)
    try:
        read_until(sock, b"\r\n\r\n" if phase == "before_first_token" else b"data: ")
        time.sleep(dwell)
        drain(sock)
    finally:
        left = time.monotonic()
        sock.close()
    took = wait_idle(worker, bound)
    return None if took is None else time.monotonic() - left


# -- the run ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Report:
    config: Config
    trials: list[Trial] = field(default_factory=list)

    def cell(self, heartbeat: float, via: str, phase: str) -> list[float | None]:
        return [
            t.let_go
            for t in self.trials
            if (t.heartbeat, t.via, t.phase) == (heartbeat, via, phase)
        ]

    @property
    def failed(self) -> int:
        return sum(t.let_go is None for t in self.trials)


def run_benchmark(config: Config, progress: Callable[[str], None]) -> Report:
    report = Report(config)
    rng = random.Random(config.seed)
    # Long enough for the slowest expected release (the next token), with room.
    bound = config.first_token_delay + config.token_gap + 10.0
    with contextlib.ExitStack() as stack:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="router-cancel-")))
        setups = start_setups(stack, log_dir, config)
        progress(f"{len(setups)} workers, each behind its own router: started")
        for setup in setups:
            heartbeat, phase, worker = setup.heartbeat, setup.phase, setup.worker
            for via, url in (("router", setup.router), ("direct", worker)):
                for _ in range(config.repeat):
                    dwell = config.dwell + rng.uniform(0, config.heartbeat)
                    took = trial(url, worker, phase, dwell, bound)
                    report.trials.append(Trial(heartbeat, via, phase, took))
                shown = ", ".join(
                    "never" if t is None else f"{t:.3f}" for t in report.cell(heartbeat, via, phase)
                )
                progress(f"{_heartbeats(heartbeat)}, {via}, {phase}: {shown}")
    return report


def _heartbeats(interval: float) -> str:
    return "heartbeats off" if interval == 0 else f"heartbeats {interval:g} s"


def _seconds(values: list[float | None]) -> str:
    if not values:
        return "-"
    if any(v is None for v in values):
        return f"never ({sum(v is None for v in values)} of {len(values)})"
    done = [v for v in values if v is not None]
    return f"{statistics.median(done):.3f} / {max(done):.3f}"


def format_report(report: Report) -> str:
    c = report.config
    heads = (
        f"before the first token (due {c.first_token_delay:g} s in)",
        f"mid-stream ({c.token_gap:g} s between tokens)",
    )
    rows = []
    for heartbeat in (c.heartbeat, 0.0):
        for via in VIAS:
            label = f"{_heartbeats(heartbeat)}, {via}"
            rows.append((label, *(_seconds(report.cell(heartbeat, via, p)) for p in PHASES)))
    lines = [
        f"client leaves -> the worker holds nothing, seconds (median / max of {c.repeat});",
        f"it leaves {c.dwell:g} to {c.dwell + c.heartbeat:g} s after the headers "
        "(or the first token)",
        *table(("", *heads), rows, align="lll"),
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    defaults = Config()
    parser.add_argument(
        "--quick", action="store_true", help="2 repetitions, a 2 s first token, 1 s gaps"
    )
    parser.add_argument("--repeat", type=int, help=f"trials per cell (default {defaults.repeat})")
    parser.add_argument(
        "--first-token-delay", type=float, help=f"default {defaults.first_token_delay}"
    )
    parser.add_argument("--token-gap", type=float, help=f"default {defaults.token_gap}")
    parser.add_argument("--heartbeat", type=float, help=f"default {defaults.heartbeat}")
    parser.add_argument("--dwell", type=float, help=f"default {defaults.dwell}")
    parser.add_argument("--seed", type=int, help="of the leave moments (default 0)")
    parser.add_argument("--json", type=Path, help="write every trial here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = QUICK if args.quick else Config()
    given = {
        name: getattr(args, name)
        for name in ("repeat", "first_token_delay", "token_gap", "heartbeat", "dwell", "seed")
        if getattr(args, name) is not None
    }
    config = Config(**{**asdict(base), **given})
    if config.heartbeat <= 0 or config.repeat < 1:
        raise SystemExit("--heartbeat must be > 0 and --repeat >= 1")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    started = time.monotonic()
    report = run_benchmark(config, progress)
    print(format_report(report))
    print(f"runtime {time.monotonic() - started:.1f} s")
    if args.json is not None:
        data = {"config": asdict(config), "trials": [asdict(t) for t in report.trials]}
        write_json(args.json, data)
        print(f"wrote {args.json}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
