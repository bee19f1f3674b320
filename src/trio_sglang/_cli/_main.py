"""``trio-sglang`` on the command line: each command, to an exit status."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import trio

from .._sglang._semantics import UnsupportedSGLang
from .._sglang._server_args import sglang_installed, wants_sglang
from ._demo import run_demo
from ._exits import BROKEN_PIPE_STATUS, first, forced_status, refuse
from ._parser import build_parser, engine_options
from ._serve_command import run_serve

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_sglang(argv) and not sglang_installed():
        return refuse(
            "--engine sglang needs SGLang: pip install 'trio-sglang[sglang]' (a GPU machine), "
            "or SGLang's CPU-importable parts (docs/engines.md; nox -s real-engine installs them)"
        )
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        commands = {
            "demo": _demo,
            "serve": run_serve,
            "dynamo-worker": _dynamo_worker,
            "bench-endpoint": _bench_endpoint,
        }
        status = commands[args.command](args)
        sys.stdout.flush()  # a reader gone shows here, not in the interpreter's last flush
    except* BrokenPipeError:
        # `trio-sglang demo | head -1`: the reader has what it wanted. Python
        # flushes stdout again at exit; pointed at devnull, that flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = BROKEN_PIPE_STATUS
    return status


def _demo(args: argparse.Namespace) -> int:
    clean = trio.run(
        lambda: run_demo(max_new_tokens=args.max_new_tokens, token_interval=args.token_interval)
    )
    return 0 if clean else 1


def _bench_endpoint(args: argparse.Namespace) -> int:
    try:
        from ..bench_endpoint._command import Refused, printable, run_command
    except ImportError as exc:
        return refuse(
            "trio-sglang bench-endpoint needs the bench extra: "
            f"pip install 'trio-sglang[bench]' ({exc})"
        )
    refusal = ""
    try:
        return run_command(args)
    except* Refused as refused:
        refusal = printable(str(first(refused)))
    return refuse(refusal)


def _dynamo_worker(args: argparse.Namespace) -> int:
    logging.getLogger("trio_sglang").setLevel(logging.INFO)
    try:
        from ..dynamo._serve import RuntimeStopped
        from ..dynamo._worker_command import Refused, run_command
    except ImportError as exc:
        return refuse(
            "trio-sglang dynamo-worker needs the dynamo extra: "
            f"pip install 'trio-sglang[dynamo]' ({exc})"
        )
    from ..server import ForcedShutdown

    refusal: str | None = None
    lost: str | None = None
    forced: int | None = None
    try:
        run_command(args, engine_options(args))
    except* Refused as refused:
        refusal = f"trio-sglang dynamo-worker: {first(refused)}"
    except* UnsupportedSGLang as old:
        refusal = f"trio-sglang dynamo-worker: {first(old)}"
    except* RuntimeStopped as stopped_serving:
        lost = f"trio-sglang dynamo-worker: {first(stopped_serving)}"
    except* ForcedShutdown as stopped:
        forced = forced_status(stopped)
    if refusal is not None:
        return refuse(refusal)
    if lost is not None:  # not the configuration's fault: exit 1, for a supervisor to restart it
        print(lost, file=sys.stderr)
        return 1
    return 0 if forced is None else forced
