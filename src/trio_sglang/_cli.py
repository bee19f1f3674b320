"""``trio-sglang`` on the command line."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from ._demo import run_demo
from ._disagg import PrefillFailed
from ._engines import EngineOptions, open_engine
from ._policy import AbortPolicy
from ._version import __version__
from .sim import SimDisaggTiming

if TYPE_CHECKING:
    from .server import HTTPPrefill

__all__ = ["main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port in [1, 65535], got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default after its help; an option with none says in words what then."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-sglang",
        description="Cancel SGLang generation requests correctly and fast.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="stream and cancel requests on the embedded SimEngine, and show what happened",
        formatter_class=_HelpFormatter,
    )
    demo.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=12,
        help="tokens each of the three requests asks for",
    )
    demo.add_argument(
        "--token-interval", type=_seconds, default=0.02, help="seconds between two tokens"
    )

    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible and SGLang-native streaming server; a disconnect cancels",
        formatter_class=_HelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument(
        "--port", type=int, default=8000, help="port to listen on; 0 picks a free one"
    )
    serve.add_argument(
        "--engine",
        choices=["sim", "sglang"],
        default="sim",
        help="sim: the embedded SimEngine, no GPU; sglang: SGLang's engine in this process, "
        "with the sglang extra on a GPU machine",
    )
    serve.add_argument(
        "--model-path",
        help="model directory or id (default: none; --engine sglang needs one)",
    )
    serve.add_argument(
        "--served-model-name",
        help="the model name clients send (default: trio-sglang-sim, or the model folder name)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=1 << 20,
        help="largest request body taken; a larger one gets 413",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=_seconds,
        default=AbortPolicy().shutdown_grace,
        help="seconds that open streams and pending engine-side cleanup get at shutdown",
    )
    disagg = serve.add_argument_group(
        "prefill/decode disaggregation (the roles of sglang-router's --pd-disaggregation)"
    )
    disagg.add_argument(
        "--disaggregation-mode",
        choices=["prefill", "decode"],
        help="run one side of a pair. On the SimEngine a prefill server also serves its KV "
        "rooms (SGLang's bootstrap server) on its HTTP port; with --engine sglang this is "
        "SGLang's --disaggregation-mode (default: none, an aggregated server)",
    )
    disagg.add_argument(
        "--prefill-url",
        help="a decode worker's prefill server (http://host:port): it then runs the prefill "
        "leg of every request that comes without bootstrap fields there, and cancels it with "
        "the request (default: none: a decode worker then takes only requests that carry "
        "bootstrap_host, bootstrap_port and bootstrap_room, from sglang-router in PD mode)",
    )
    disagg.add_argument(
        "--prefill-bootstrap-port",
        type=_port,
        help="where decode engines reach the --prefill-url server's KV rooms (default: its "
        "HTTP port, right for a SimEngine prefill server; for one on SGLang, its "
        "--disaggregation-bootstrap-port, 8998 unless set)",
    )
    sim = serve.add_argument_group("SimEngine timing (in seconds, but the chunk size in tokens)")
    sim.add_argument(
        "--sim-tokenize-delay",
        type=_seconds,
        default=0.005,
        help="from a request's arrival to the end of its tokenization",
    )
    sim.add_argument(
        "--sim-dispatch-delay",
        type=_seconds,
        default=0.001,
        help="from the end of tokenization to the push to the scheduler, per child of a batch",
    )
    sim.add_argument(
        "--sim-first-token-delay",
        type=_seconds,
        default=0.05,
        help="from the push to the scheduler to the first token: queueing and prefill",
    )
    sim.add_argument("--sim-token-interval", type=_seconds, default=0.02, help="between two tokens")
    timing = SimDisaggTiming()
    sim.add_argument(
        "--sim-prefill-time-per-token",
        type=_seconds,
        default=timing.prefill_time_per_token,
        help="a disaggregated prefill's compute per prompt token; a prompt word is a token",
    )
    sim.add_argument(
        "--sim-prefill-chunk-tokens",
        type=_positive_int,
        default=timing.prefill_chunk_tokens,
        help="prompt tokens per prefill forward; a cancel takes effect between forwards",
    )
    sim.add_argument(
        "--sim-bootstrap-delay",
        type=_seconds,
        default=timing.bootstrap_delay,
        help="the decode side's handshake with the prefill side",
    )
    sim.add_argument(
        "--sim-kv-transfer-delay",
        type=_seconds,
        default=timing.kv_transfer_delay,
        help="sending the KV cache from the prefill side to the decode side",
    )
    sim.add_argument(
        "--sim-kv-wait-timeout",
        type=_seconds,
        default=timing.kv_wait_timeout,
        help="how long the decode side waits for a KV cache; the default is SGLang's",
    )
    return parser


#: How a shell reports a program that SIGPIPE ended (128 + 13), as ``demo | head`` expects.
_BROKEN_PIPE_STATUS = 141


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        status = _demo(args) if args.command == "demo" else _serve(args)
        sys.stdout.flush()  # a reader gone shows here, not in the interpreter's last flush
    except* BrokenPipeError:
        # `trio-sglang demo | head -1`: the reader has what it wanted. Python
        # flushes stdout again at exit; pointed at devnull, that flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = _BROKEN_PIPE_STATUS
    return status


def _demo(args: argparse.Namespace) -> int:
    clean = trio.run(
        lambda: run_demo(max_new_tokens=args.max_new_tokens, token_interval=args.token_interval)
    )
    return 0 if clean else 1


def _refuse(message: str) -> int:
    """A configuration the server cannot run with: one line on stderr, and exit status 2."""
    print(message, file=sys.stderr)
    return 2


def _serve(args: argparse.Namespace) -> int:
    logging.getLogger("trio_sglang").setLevel(logging.INFO)
    try:
        from .server import HTTPPrefill, ListenError
    except ImportError as exc:
        return _refuse(
            f"trio-sglang serve needs the serve extra: pip install 'trio-sglang[serve]' ({exc})"
        )
    if args.engine == "sglang":
        if not args.model_path:
            return _refuse("--engine sglang needs --model-path")
        if any(importlib.util.find_spec(name) is None for name in ("sglang", "trio_asyncio")):
            return _refuse(
                "--engine sglang needs SGLang: pip install 'trio-sglang[sglang]' (a GPU machine)"
            )
    if args.prefill_url is not None and args.disaggregation_mode != "decode":
        return _refuse("--prefill-url is for a decode worker: add --disaggregation-mode decode")
    if args.prefill_bootstrap_port is not None and args.prefill_url is None:
        return _refuse("--prefill-bootstrap-port goes with --prefill-url")
    prefill = None
    if args.prefill_url is not None:
        try:
            prefill = HTTPPrefill(args.prefill_url, bootstrap_port=args.prefill_bootstrap_port)
        except ValueError as exc:
            return _refuse(f"--prefill-url: {exc}")
    # Everything imported so far lives as long as the process: out of the
    # collector's sight, a full collection under load walks far fewer objects
    # (its pauses are what a disconnect waits for at p99).
    gc.freeze()
    # Both come at startup, nested in nurseries; anything else (KeyboardInterrupt
    # included) goes on up as it is.
    refusal: str | None = None
    try:
        trio.run(_serve_until_stopped, args, prefill)
    except* PrefillFailed as failed:  # the prefill server's first check
        refusal = f"the prefill server is not usable: {_first(failed)}"
    except* ListenError as failed:  # a port in use, an address not on this machine
        refusal = str(_first(failed))
    return 0 if refusal is None else _refuse(refusal)


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception a (nested) group holds."""
    found: BaseException = group
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    return found


async def _serve_until_stopped(args: argparse.Namespace, prefill: HTTPPrefill | None) -> None:
    """The engine, and what one side of a disaggregated pair needs, around the server."""
    from .server import serve

    async with contextlib.AsyncExitStack() as stack:
        engine, hosted = await stack.enter_async_context(open_engine(_engine_options(args)))
        if prefill is not None:
            await stack.enter_async_context(prefill)
        await serve(
            engine,
            host=args.host,
            port=args.port,
            model=args.served_model_name or _default_model_name(args),
            policy=AbortPolicy(shutdown_grace=args.shutdown_grace),
            max_body_bytes=args.max_body_bytes,
            prefill=prefill,
            kv_rooms=hosted,
        )


def _engine_options(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(
        kind=args.engine,
        disaggregation_mode=args.disaggregation_mode,
        model_path=args.model_path,
        sim_args={
            "tokenize_delay": args.sim_tokenize_delay,
            "dispatch_delay": args.sim_dispatch_delay,
            "first_token_delay": args.sim_first_token_delay,
            "token_interval": args.sim_token_interval,
            "disagg_timing": SimDisaggTiming(
                prefill_time_per_token=args.sim_prefill_time_per_token,
                prefill_chunk_tokens=args.sim_prefill_chunk_tokens,
                bootstrap_delay=args.sim_bootstrap_delay,
                kv_transfer_delay=args.sim_kv_transfer_delay,
                kv_wait_timeout=args.sim_kv_wait_timeout,
            ),
        },
    )


def _default_model_name(args: argparse.Namespace) -> str:
    if args.engine == "sglang":
        return Path(args.model_path).name
    return "trio-sglang-sim"
