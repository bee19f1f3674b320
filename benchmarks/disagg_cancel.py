"""Disaggregated-prefill cancel benchmark: what a client's cancel leaves running on a PD pair.

    python benchmarks/disagg_cancel.py [--quick | --full] [--requests N] [--load L]
        [--cancel-share S] [--seed S] [--out DIR] [--json PATH]

What it measures and how, the approaches, the workload and every metric:
docs/benchmarks.md, "Disaggregated prefill: what a cancel leaves running".
``--full`` is the default size, so that ``nox -s bench -- --full`` can pass it
to both benchmarks.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from _disagg_metrics import HELD_AFTER, PHASES, ApproachResult, summarize
from _disagg_run import PD_APPROACHES, PROGRESS_STEPS, Workload, run_approach
from _output import Progress, add_file_options, number, results_folder, table, wrap
from _report_base import Column, SummaryReport, columns_table
from _stats import percentiles
from _units import sig3
from _verdict import Target
from cancel_latency import counting_worker_log

__all__ = ["FULL", "QUICK", "Config", "Report", "build_parser", "main", "run_benchmark"]

#: The default run, and ``--quick`` (what CI runs, a few seconds).
FULL = Workload()
QUICK = replace(FULL, requests=300)
CLOCK = (
    "trio.testing.MockClock(autojump_threshold=0): every duration is sim seconds, the "
    "modelled engines' (GPU) time, exact; not wall time"
)


@dataclass(frozen=True, slots=True)
class Config:
    """One run's plan: the workload, and the approaches that each run it from scratch."""

    workload: Workload = FULL
    approaches: tuple[str, ...] = tuple(PD_APPROACHES)

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.workload.to_json(), "approaches": list(self.approaches)}


@dataclass(slots=True)
class Report(SummaryReport):
    """Everything one run measured: sim seconds, exact, so it sets no target."""

    config: Config
    results: list[ApproachResult] = field(default_factory=list)
    #: The workers' log records during the run, counted by message template.
    worker_log: dict[str, int] = field(default_factory=dict)
    runtime_s: float = 0.0

    def targets(self) -> list[Target]:
        return []

    def lines(self) -> list[str]:
        return [
            *self._totals(wrap(f"Decode side ({HELD}; 'never' = still held at the end):")),
            "",
            "Per phase at the cancel (wasted prefill s, decode hold s: p50/p99/max):",
            "",
            *table(
                ["phase", "approach", "cancels", "wasted prefill", "held", "decode hold"],
                _phase_rows(self.results),
                align="llrrrr",
            ),
            "",
            *self._runtime_lines(),
        ]

    def markdown(self) -> str:
        """This benchmark's section of ``summary.md``: the two totals tables."""
        return "\n".join(
            [
                "## Prefill/decode pair (disagg_cancel.py)",
                "",
                *self._totals([f"Decode side ({HELD}):"], markdown=True),
                "",
            ]
        )

    def _totals(self, decode_about: list[str], *, markdown: bool = False) -> list[str]:
        """The about lines and the two totals tables, as text or Markdown."""
        return [
            *self._about(),
            "",
            PREFILL_ABOUT,
            "",
            *columns_table(PREFILL, self.results, markdown=markdown),
            "",
            *decode_about,
            "",
            *columns_table(DECODE, self.results, markdown=markdown),
        ]

    def _about(self) -> list[str]:
        w = self.config.workload
        t = w.timing.disagg
        return wrap(
            f"Disaggregated cancels: {w.requests:,} requests, offered prefill load {w.load:g}, "
            f"{w.cancel_share:.0%} of clients leave at a random moment (seed {w.seed}). "
            f"Clock: {CLOCK}. Prefill {1 / t.prefill_time_per_token:,.0f} tokens/s in chunks of "
            f"{t.prefill_chunk_tokens:,}; KV wait timeout {t.kv_wait_timeout:g} s."
        )

    def _runtime_lines(self) -> list[str]:
        texts = [
            f"{r.approach}: last client left at sim {r.last_client_s:,.0f} s, engines empty at "
            f"{r.settled_s:,.0f} s; baseline bound hits {r.bound_hits}; "
            f"{r.runtime_s:.1f} s of wall time"
            for r in self.results
        ]
        texts.append(f"runtime: {self.runtime_s:.1f} s of wall time")
        if self.worker_log:
            texts.append(f"worker log: {self.worker_log}")
        return [line for text in texts for line in wrap(text)]

    def to_json(self, machine: dict[str, Any]) -> dict[str, Any]:
        return {
            "clock": CLOCK,
            "results": [result.to_json() for result in self.results],
            "phases": PHASES,
            "held_after_s": HELD_AFTER,
            "worker_log": self.worker_log,
            "config": self.config.to_json(),
            "machine": machine,
            "runtime_s": round(self.runtime_s, 1),
        }


def run_benchmark(config: Config, progress: Progress | None = None) -> Report:
    """Run every approach on the config's workload, each in its own ``trio.run`` on MockClock."""
    total = len(config.approaches) * PROGRESS_STEPS
    steps = Progress(total, stream=io.StringIO()) if progress is None else progress
    report = Report(config)
    started = time.perf_counter()
    per_token = config.workload.timing.disagg.prefill_time_per_token
    for name in config.approaches:
        # One run's traces are summarized and dropped before the next run starts.
        report.results.append(summarize(run_approach(name, config.workload, steps), per_token))
    report.runtime_s = time.perf_counter() - started
    return report


# -- the tables --------------------------------------------------------------------


def _triple(samples: Sequence[float]) -> str:
    """p50/p99/max; "-" when there is no sample."""
    if not samples:
        return "-"
    stats = percentiles(samples)
    return "/".join(sig3(stats[key]) for key in ("p50", "p99", "max"))


PREFILL_ABOUT = "Prefill side (sim seconds; p50/p99/max; HOL: the delay to others' first tokens):"
HELD = f"'held': let go more than {HELD_AFTER * 1e3:g} ms after the cancel"
PREFILL: list[Column[ApproachResult]] = [
    ("approach", lambda r: r.approach),
    ("cancels", lambda r: f"{r.cancels:,}"),
    ("forward s", lambda r: f"{r.prefill_forward_s:,.0f}"),
    ("wasted s", lambda r: f"{sum(r.wasted_prefill_s):,.1f}"),
    ("wasted/cancel", lambda r: _triple(r.wasted_prefill_s)),
    ("HOL s", lambda r: f"{sum(r.hol_delay_s):,.0f}"),
    ("HOL/stayer", lambda r: _triple(r.hol_delay_s)),
    ("stayer TTFT", lambda r: _triple(r.ttft_s)),
]
DECODE: list[Column[ApproachResult]] = [
    ("approach", lambda r: r.approach),
    ("held", lambda r: f"{r.decode_held:,}"),
    ("hold s/cancel", lambda r: _triple(r.decode_hold_s)),
    ("kv timeouts", lambda r: f"{r.kv_timeouts:,}"),
    ("tokens after", lambda r: f"{r.decode_tokens_after_cancel:,}"),
    ("stayers failed", lambda r: f"{r.stayed_failed:,}"),
    ("live at end", lambda r: f"{r.live_at_end:,}"),
    ("lost", lambda r: f"{r.aborts_lost:,}"),
]


def _phase_rows(results: Sequence[ApproachResult]) -> list[list[str]]:
    rows = []
    for name in PHASES:
        for r in results:
            phase = r.phases[name]
            rows.append(
                [
                    name if r is results[0] else "",
                    r.approach,
                    f"{phase.cancels:,}",
                    _triple(phase.wasted_prefill_s),
                    f"{phase.decode_held:,}",
                    _triple(phase.decode_hold_s),
                ]
            )
    return rows


# -- the command line --------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disagg_cancel.py",
        description="Prefill compute wasted and decode KV held after cancels on a "
        "prefill/decode pair: trio-sglang vs Dynamo's first-response worker and a "
        "prefill-only abort, on SimEngines and trio's MockClock.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help=f"{QUICK.requests} requests (CI, a few seconds)"
    )
    size.add_argument(
        "--full",
        action="store_true",
        help=f"the default size, {FULL.requests:,} requests (for nox -s bench -- --full)",
    )
    parser.add_argument("--requests", type=number(int, 1, 10**6), help=f"default {FULL.requests:,}")
    parser.add_argument(
        "--load",
        type=number(float, 0.01, 2.0),
        help=f"offered prefill load, all prefills computed whole (default {FULL.load})",
    )
    parser.add_argument(
        "--cancel-share",
        type=number(float, 0.0, 1.0),
        help=f"share of clients that leave early (default {FULL.cancel_share})",
    )
    parser.add_argument("--seed", type=int, help="default 0")
    add_file_options(parser, "disagg.json and its section of summary.md")
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    workload = QUICK if args.quick else FULL
    chosen = {
        name: getattr(args, name)
        for name in ("requests", "load", "cancel_share", "seed")
        if getattr(args, name) is not None
    }
    return Config(replace(workload, **chosen))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    folder = results_folder(args.out)
    progress = Progress(len(config.approaches) * PROGRESS_STEPS)
    with counting_worker_log() as counts:
        report = run_benchmark(config, progress)
    progress.finish()
    report.worker_log = dict(counts)
    print(report.format())
    print("\nfiles:")
    for path in report.save(folder, args.json, "disagg.json"):
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
