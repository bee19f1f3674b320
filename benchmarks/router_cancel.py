"""Behind sglang-router: from a streaming client leaving to the worker letting go.

    python benchmarks/router_cancel.py [--quick] [--repeat 5] [--first-token-delay 5]
        [--token-gap 2] [--heartbeat 0.1] [--json PATH]

A ``bench-endpoint`` scenario on ``hop_cancel.py``'s ``behind_router``; why
the router lets go only at its next write, and the setup, are in
docs/benchmarks.md, "Behind sglang-router: a client leaving". Each client
through the router, then each to the worker directly (the reference), goes
one at a time: each release is then the only drop of the gauge in its wave,
and each client finds the worker idle, so none waits on another's release.

Table on stdout, progress on stderr, each cell's releases in ``--json PATH``;
exit status 1 if a request was leaked (still held after both delays and a
margin) or failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from _output import table, write_json
from _units import ms
from hop_cancel import behind_router, bench
from trio_sglang.bench_endpoint._report import PhaseResult, percentile

__all__ = ["Config", "main", "run_benchmark"]

#: The columns: how the clients leave, one worker timing each.
PHASES = ("before_first_token:close", "mid_stream:close")
VIAS = ("router", "direct")
#: Beyond both delays, how long a release may take before it counts as leaked.
SETTLE_MARGIN = 10.0

#: A cell's key: the heartbeat interval (0: off), the way in, the phase.
Cell = tuple[float, str, str]


@dataclass(frozen=True, slots=True)
class Config:
    #: Clients per cell.
    repeat: int = 5
    #: Seconds from a request to its first token on the before-the-first-token worker.
    first_token_delay: float = 5.0
    #: Seconds between two tokens on the mid-stream worker.
    token_gap: float = 2.0
    #: ``--sse-heartbeat`` of the workers with heartbeats on.
    heartbeat: float = 0.1

    @property
    def leave_delay(self) -> float:
        """Seconds from sending to leaving before the first token: half its delay, clear of
        both the headers and the token."""
        return self.first_token_delay / 2


QUICK = Config(repeat=2, first_token_delay=2.0, token_gap=1.0)


def worker_args(config: Config, phase: str, heartbeat: float) -> tuple[str, ...]:
    """``serve``'s options for ``phase``: a silence long enough to leave in, before the first
    token or between two."""
    timing = {
        "before_first_token:close": ("--sim-first-token-delay", f"{config.first_token_delay:g}"),
        "mid_stream:close": ("--sim-token-interval", f"{config.token_gap:g}"),
    }
    return (*timing[phase], "--sse-heartbeat", f"{heartbeat:g}")


def leaving(config: Config, phase: str) -> tuple[str, ...]:
    """bench-endpoint's options for ``phase``. Mid-stream a client leaves after one token, at
    the start of the gap. The settle outlasts a release held to the next token (the first
    one, or the end of the gap), so that one is measured, not counted as leaked."""
    settle = config.first_token_delay + config.token_gap + SETTLE_MARGIN
    return (
        *("--api", "sglang-generate", "--phases", phase, "--concurrency", "1"),
        *("--leave-delay", f"{config.leave_delay:g}", "--mid-stream-chunks", "1"),
        *("--settle", f"{settle:g}"),
    )


def run_benchmark(
    config: Config, work: Path, progress: Callable[[str], None]
) -> dict[Cell, PhaseResult]:
    """Each worker in turn, stopped before the next starts: its cells through the router and
    direct."""
    cells: dict[Cell, PhaseResult] = {}
    for heartbeat in (config.heartbeat, 0.0):
        for phase in PHASES:
            folder = work / f"{phase.partition(':')[0]}-{heartbeat:g}"
            folder.mkdir()  # the router and its worker log to fixed names: a folder each
            args = worker_args(config, phase, heartbeat)
            with behind_router(folder, "sglang-router", *args) as setups:
                for via, setup in zip(VIAS, setups, strict=True):
                    out = folder / f"{via}.json"
                    (result,) = bench(setup, out, config.repeat, leaving(config, phase)).phases
                    cells[heartbeat, via, phase] = result
                    progress(f"{_heartbeats(heartbeat)}, {via}, {phase}: {_cell(result)}")
    return cells


def _heartbeats(interval: float) -> str:
    return "heartbeats off" if interval == 0 else f"heartbeats {interval:g} s"


def _cell(result: PhaseResult) -> str:
    """p50 / max, then what was leaked or failed, if anything."""
    released = result.release_ms
    shown = f"{ms(percentile(released, 0.5))} / {ms(max(released))}" if released else "-"
    lost = [
        f"{word} {n}" for word, n in (("leaked", result.leaked), ("failed", result.failed)) if n
    ]
    return ", ".join([shown, *lost])


def format_table(config: Config, cells: dict[Cell, PhaseResult]) -> str:
    heads = (
        f"before the first token (due {config.first_token_delay:g} s in)",
        f"mid-stream ({config.token_gap:g} s between tokens)",
    )
    rows = [
        (f"{_heartbeats(heartbeat)}, {via}", *(_cell(cells[heartbeat, via, p]) for p in PHASES))
        for heartbeat in (config.heartbeat, 0.0)
        for via in VIAS
    ]
    lines = [
        f"client leaves -> the worker holds nothing, ms (p50 / max of {config.repeat});",
        f"it leaves {config.leave_delay:g} s after sending, or at the first token",
        *table(("", *heads), rows, align="lll"),
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    defaults = Config()
    parser.add_argument(
        "--quick", action="store_true", help="2 clients a cell, a 2 s first token, 1 s gaps"
    )
    parser.add_argument("--repeat", type=int, help=f"clients per cell (default {defaults.repeat})")
    parser.add_argument(
        "--first-token-delay", type=float, help=f"default {defaults.first_token_delay}"
    )
    parser.add_argument("--token-gap", type=float, help=f"default {defaults.token_gap}")
    parser.add_argument("--heartbeat", type=float, help=f"default {defaults.heartbeat}")
    parser.add_argument("--json", type=Path, help="write every cell's releases here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = QUICK if args.quick else Config()
    given = {
        name: getattr(args, name)
        for name in ("repeat", "first_token_delay", "token_gap", "heartbeat")
        if getattr(args, name) is not None
    }
    config = Config(**{**asdict(base), **given})
    if config.heartbeat <= 0 or config.repeat < 1:
        raise SystemExit("--heartbeat must be > 0 and --repeat >= 1")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="router-cancel-") as work:
        cells = run_benchmark(config, Path(work), progress)
    print(format_table(config, cells))
    print(f"runtime {time.monotonic() - started:.1f} s")
    if args.json is not None:
        data = {
            f"{_heartbeats(heartbeat)}, {via}, {phase}": {
                "release_ms": result.release_ms,
                "leaked": result.leaked,
                "failed": result.failed,
            }
            for (heartbeat, via, phase), result in cells.items()
        }
        write_json(args.json, {"config": asdict(config), "cells": data})
        print(f"wrote {args.json}")
    return 1 if any(r.leaked or r.failed for r in cells.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
