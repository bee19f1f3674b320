"""``trio-sglang`` on the command line."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import trio

from ._demo import run_demo
from ._version import __version__

__all__ = ["main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-sglang", description="Cancel SGLang generation requests correctly and fast."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="stream and cancel requests on the embedded SimEngine, and show what happened"
    )
    demo.add_argument("--max-new-tokens", type=_positive_int, default=12)
    demo.add_argument("--token-interval", type=_seconds, default=0.02, help="seconds")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        clean = trio.run(
            lambda: run_demo(max_new_tokens=args.max_new_tokens, token_interval=args.token_interval)
        )
        return 0 if clean else 1
    raise AssertionError(f"unhandled command {args.command!r}")
