"""Load over loopback: many streaming clients against ``trio-sglang serve``, some leaving.

    python benchmarks/load.py [--quick] [--scenario load|edge] [--clients 1000]
        [--duration 30] [--disconnect-fraction 0.333] [--seed 0]
        [--nonreaders N] [--tricklers N] [--zero-window N] [--bad-peers N] [--json PATH]

How it runs, what it judges and what the edge scenario adds: docs/benchmarks.md, "Load
over loopback" and "Hostile clients beside the load". Progress on stderr, the table on
stdout, every number in the JSON; the exit status is 1 if an invariant failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from _load_bad_peer import open_bad_peers
from _load_config import HOSTILE_CAPS, Config, EdgeConfig
from _load_edge_report import EdgeReport
from _load_hostile import HostileTally, run_hostile
from _load_report import LoadReport
from _load_run import progress_steps, run_server
from _output import Progress, machine, number, write_json
from trio_sglang._cli._field_options import positive_int

__all__ = ["main", "run_edge", "run_load"]

RESULTS = Path(__file__).resolve().parent / "results"
QUICK = {"clients": 200, "duration": 8.0, "warmup_clients": 20, "warmup_duration": 1.0}
SCENARIOS = ("load", "edge")
#: The edge scenario's progress steps: its two phases', and the bad peers' start and end.
EDGE_STEPS = progress_steps(2) + 2


async def run_load(config: Config, progress: Progress) -> LoadReport:
    """Start the server, warm it up, load it, let it settle, stop it; report."""
    run = await run_server(config, progress, [("load", None)])
    return run.report()


async def run_edge(config: Config, edge: EdgeConfig, progress: Progress) -> EdgeReport:
    """One server with ``edge``'s bounds: the load alone, then beside the hostile clients;
    the bad peers' decode server beside it from before the baseline to the end."""
    hostile = HostileTally()
    progress.start("starting a hostile KV peer, and a decode server whose prefill peer it is")
    async with open_bad_peers(edge, config) as bad_peers:
        progress.step_done()

        async def beside(url: str, model: str) -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_hostile, url, model, edge, config, hostile)
                nursery.start_soon(bad_peers.run_clients)

        phases = [("baseline", None), ("edge", beside)]
        run = await run_server(config, progress, phases, edge.serve_args())
        progress.start("bad peers: the decode server's settle, then SIGINT")
        peers = await bad_peers.finish()
        progress.step_done()
    return EdgeReport(run, edge, hostile, peers)


# -- the command line ---------------------------------------------------------------


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
    parser.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="load",
        help="load: the clients alone; edge: the clients alone, then beside hostile clients "
        "(non-readers, tricklers, zero-window HTTP/2 clients, flooders, pipeliners, resetters, "
        "fan-out clients, bad KV peers), on one server with short client bounds (default load)",
    )
    parser.add_argument("--clients", type=positive_int, help=f"default {defaults.clients}")
    parser.add_argument(
        "--duration",
        type=number(float, 0, above=True),
        help=f"seconds (default {defaults.duration:g})",
    )
    parser.add_argument(
        "--disconnect-fraction",
        type=number(float, 0, 1),
        help="share of requests abandoned at a random moment, half of them before the first "
        "token (default 1/3)",
    )
    parser.add_argument("--seed", type=int, help="default 0")
    parser.add_argument(
        "--token-interval",
        type=number(float, 0, above=True),
        help=f"the SimEngine's seconds between tokens (default {defaults.token_interval:g})",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        help=f"tokens per request (default {defaults.max_tokens})",
    )
    for name, what in (
        ("nonreaders", "streaming clients that never read their answer"),
        ("tricklers", "clients that send their body a byte at a time"),
        ("zero_window", "HTTP/2 clients that grant no flow-control window and never read"),
        ("bad_peers", "clients whose requests make a decode server read a hostile KV peer"),
        ("flooders", "HTTP/2 clients that send PRIORITY frames asking for nothing"),
        ("pipeliners", "clients that pipeline a byte behind a request, then reset"),
        ("resetters", "HTTP/2 clients that send a burst of streams, then reset"),
        ("fanout", "clients whose requests ask for many completions (n), at the server's bound"),
    ):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=number(int, 0),
            help=f"--scenario edge: {what} (default 10%% of --clients, at most "
            f"{HOSTILE_CAPS[name]})",
        )
    parser.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="where the results go (default benchmarks/results/load.json, "
        "load-quick.json with --quick; load-edge[-quick].json for --scenario edge)",
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


def edge_from_args(args: argparse.Namespace, config: Config) -> EdgeConfig:
    counts = {name: getattr(args, name) for name in HOSTILE_CAPS}
    return EdgeConfig.for_clients(config.clients, **counts)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    name = "load" if args.scenario == "load" else f"load-{args.scenario}"
    path = args.json or RESULTS / (f"{name}-quick.json" if args.quick else f"{name}.json")
    print(
        f"SimEngine timing for load: {' '.join(config.serve_args())}; {config.max_tokens} "
        "tokens per request (why: Config in benchmarks/_load_config.py)",
        file=sys.stderr,
    )
    report: LoadReport | EdgeReport
    if args.scenario == "edge":
        edge = edge_from_args(args, config)
        print(
            f"edge: {edge.nonreaders} non-readers, {edge.tricklers} tricklers, "
            f"{edge.zero_window} zero-window clients, {edge.flooders} flooders, "
            f"{edge.pipeliners} pipeliners, {edge.resetters} resetters, {edge.fanout} fan-out "
            f"clients and {edge.bad_peers} bad peers beside the clients; server bounds "
            f"{' '.join(edge.serve_args())} (why: EdgeConfig)",
            file=sys.stderr,
        )
        progress = Progress(total=EDGE_STEPS)
        report = trio.run(run_edge, config, edge, progress)
    else:
        progress = Progress(total=progress_steps(1))
        report = trio.run(run_load, config, progress)
    progress.finish()
    print(report.format())
    write_json(path, report.to_json(machine()))
    print(f"\nJSON: {path}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
