"""The command: options to a plan, the run, and its outputs (table, JSON, PNG), or a comparison.

Problems a user can fix (a bad option, an unreachable server, a page
without known gauges) come out as ``Refused`` (alone, or in an exception
group from inside the run), which the CLI prints as one line with exit
status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import trio

from .._limits import API_KEY_ENV
from ._departures import ALL_PHASES, parse_phases
from ._plot import plot
from ._report import Report, compare_table, load, table
from ._run import Plan, Refused, run_bench
from ._servers import kind_from_option
from ._visits import Target

__all__ = ["Refused", "plan_from_options", "printable", "run_command"]


def printable(text: str) -> str:
    """``text`` with what a terminal would act on escaped: a server's answer (an error's
    words, a metric's labels) reaches the operator's screen, and must not move its
    cursor, retitle its window or hide lines."""
    return "".join(
        char if char.isprintable() or char == "\n" else char.encode("unicode_escape").decode()
        for char in text
    )


def run_command(args: argparse.Namespace) -> int:
    if args.compare:
        if args.url:
            raise Refused("--compare prints saved runs and runs nothing: drop --url")
        print(printable(compare_table([_load(path) for path in args.compare])))
        return 0
    plan = plan_from_options(args)
    progress = _Progress()
    try:
        report = trio.run(run_bench, plan, progress)
    finally:
        progress.done()
    print(printable(table(report)))
    for option, write in ((args.json, report.save), (args.plot, lambda path: plot(report, path))):
        if option:
            write(Path(option))
            print(f"wrote {option}", file=sys.stderr)
    return 0


def _load(path: str) -> tuple[str, Report]:
    try:
        return Path(path).stem, load(Path(path))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise Refused(f"--compare: cannot read {path}: {exc}") from exc


def plan_from_options(args: argparse.Namespace) -> Plan:
    """The run the options ask for; ``Refused`` for options that cannot make one."""
    if not args.url:
        raise Refused("trio-sglang bench-endpoint needs --url (or --compare A.json B.json)")
    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise Refused(f"--url must start with http:// or https://, got {args.url!r}")
    if args.mid_stream_chunks >= args.max_tokens:
        raise Refused(
            "--mid-stream-chunks must be below --max-tokens, or no client leaves mid-stream"
        )
    if args.sample_interval <= 0:
        raise Refused("--sample-interval must be above 0")
    try:
        phases = parse_phases(args.phases) if args.phases else ALL_PHASES
        kind = kind_from_option(args.metrics) if args.metrics else None
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    # Read here, not as the option's default: --help would print it.
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    target = Target(
        url=url,
        api=args.api,
        model=args.model,
        headers=headers,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        ignore_eos=args.ignore_eos,
        timeout=args.request_timeout,
    )
    return Plan(
        target=target,
        metrics_urls=tuple(args.metrics_url or [f"{url}/metrics"]),
        kind=kind,
        phases=phases,
        concurrency=args.concurrency,
        requests=args.requests,
        leave_delay=args.leave_delay,
        mid_stream_chunks=args.mid_stream_chunks,
        sample_interval=args.sample_interval,
        settle=args.settle,
    )


class _Progress:
    """One line on stderr, rewritten in place on a terminal; a line per step elsewhere."""

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._width = 0

    def __call__(self, message: str) -> None:
        line = f"bench-endpoint: {message}"
        if self._tty:
            sys.stderr.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self._tty and self._width:
            sys.stderr.write("\n")
