"""``trio-sglang`` on the command line."""

from __future__ import annotations

import argparse
import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path

import trio

from ._demo import run_demo
from ._engine import Engine
from ._policy import AbortPolicy
from ._sglang_engine import SGLangEngine
from ._sim_engine import SimEngine
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

    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible and SGLang-native streaming server; a disconnect cancels",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    serve.add_argument("--engine", choices=["sim", "sglang"], default="sim")
    serve.add_argument("--model-path", help="model directory or id (for --engine sglang)")
    serve.add_argument(
        "--served-model-name",
        help="the model name clients send (default: trio-sglang-sim, or the model folder name)",
    )
    serve.add_argument("--max-body-bytes", type=_positive_int, default=1 << 20)
    serve.add_argument("--shutdown-grace", type=_seconds, default=1.0, help="seconds")
    sim = serve.add_argument_group("SimEngine timing (seconds)")
    sim.add_argument("--sim-tokenize-delay", type=_seconds, default=0.005)
    sim.add_argument("--sim-dispatch-delay", type=_seconds, default=0.001)
    sim.add_argument("--sim-first-token-delay", type=_seconds, default=0.05)
    sim.add_argument("--sim-token-interval", type=_seconds, default=0.02)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        clean = trio.run(
            lambda: run_demo(max_new_tokens=args.max_new_tokens, token_interval=args.token_interval)
        )
        return 0 if clean else 1
    return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    logging.getLogger("trio_sglang").setLevel(logging.INFO)
    try:
        from .server import serve
    except ImportError as exc:
        print(f"trio-sglang serve needs the serve extra: pip install 'trio-sglang[serve]' ({exc})")
        return 2
    engine: Engine
    if args.engine == "sglang":
        if not args.model_path:
            print("--engine sglang needs --model-path")
            return 2
        if importlib.util.find_spec("sglang") is None:
            print("--engine sglang needs SGLang: pip install 'trio-sglang[sglang]' (a GPU machine)")
            return 2
        engine = SGLangEngine(model_path=args.model_path)
    else:
        engine = SimEngine(
            tokenize_delay=args.sim_tokenize_delay,
            dispatch_delay=args.sim_dispatch_delay,
            first_token_delay=args.sim_first_token_delay,
            token_interval=args.sim_token_interval,
        )
    trio.run(
        lambda: serve(
            engine,
            host=args.host,
            port=args.port,
            model=args.served_model_name or _default_model_name(args),
            policy=AbortPolicy(shutdown_grace=args.shutdown_grace),
            max_body_bytes=args.max_body_bytes,
        )
    )
    return 0


def _default_model_name(args: argparse.Namespace) -> str:
    if args.engine == "sglang":
        return Path(args.model_path).name
    return "trio-sglang-sim"
