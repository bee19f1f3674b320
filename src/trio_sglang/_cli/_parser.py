"""``trio-sglang``'s parser, and what its options build: the server's limits, the
shutdown's policy, the engine's options."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from .._asyncio_bridge._asyncio_side import LOOP_KINDS
from .._core._policy import AbortPolicy
from .._limits import API_KEY_ENV, ServerLimits
from .._sglang._server_args import add_sglang_options, sglang_installed, wants_sglang
from .._version import __version__
from ..bench_endpoint._options import add_options as add_bench_endpoint_options
from ..dynamo._worker_options import add_options as add_dynamo_worker_options
from ..sim import SimDisaggTiming
from ._engines import EngineOptions
from ._field_options import FieldOptions, port_number, positive_int, seconds

__all__ = ["abort_policy", "build_parser", "engine_options", "server_limits"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default after its help; an option with none says in words what then."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """trio-sglang's parser; for ``argv`` (the command line it will parse), with SGLang's
    server arguments on ``serve`` and ``dynamo-worker`` when it asks for ``--engine sglang``,
    or for help where SGLang is installed (``_sglang/_server_args.py``)."""
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
        type=positive_int,
        default=12,
        help="tokens each of the three requests asks for",
    )
    demo.add_argument(
        "--token-interval", type=seconds, default=0.02, help="seconds between two tokens"
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
    _add_engine_option(serve)
    _add_loop_option(
        serve,
        "with --engine sglang, how trio shares the thread with SGLang's asyncio code: guest "
        "(trio as the guest of uvloop, which runs SGLang at full speed) or trio-asyncio "
        "(trio as the host; the asyncio extra) (default: guest)",
    )
    serve.add_argument(
        "--model-path",
        help="model directory or id (default: none; --engine sglang needs one)",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        help="the model's name in /v1/models and /server_info; repeat it for aliases, the "
        "first one the model's own (default: trio-sglang-sim, or the model folder name)",
    )
    serve.add_argument(
        "--chat-template",
        help="with --engine sglang, SGLang's --chat-template: a Jinja file, or a template "
        "name, for /v1/chat/completions (default: the model's own; the SimEngine's is its "
        "plain transcript)",
    )
    serve.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="SGLang's: OpenAI usage reports the prompt tokens the engine's prefix cache "
        "held, as prompt_tokens_details.cached_tokens",
    )
    _add_limits(serve)
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
        type=port_number,
        help="where decode engines reach the --prefill-url server's KV rooms (default: its "
        "HTTP port, right for a SimEngine prefill server; for one on SGLang, its "
        "--disaggregation-bootstrap-port, 8998 unless set)",
    )
    _add_sim_options(serve)
    worker = _add_dynamo_worker(commands)
    for command in (serve, worker):
        _add_sglang_group(command, argv)
    bench = commands.add_parser(
        "bench-endpoint",
        help="how fast any serving endpoint lets go of clients that leave, from its own metrics",
        formatter_class=_HelpFormatter,
    )
    add_bench_endpoint_options(bench, count=positive_int, seconds=seconds)
    return parser


def _add_engine_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--engine",
        choices=["sim", "sglang"],
        default="sim",
        help="sim: the embedded SimEngine, no GPU; sglang: SGLang's own engine in this process "
        "(the sglang extra), on a GPU or, with --device cpu, on this CPU; it takes SGLang's "
        "server arguments, listed below where SGLang is installed",
    )


def _add_loop_option(command: argparse.ArgumentParser, help: str) -> None:
    command.add_argument("--loop", choices=LOOP_KINDS, help=help)


def _add_sglang_group(command: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """SGLang's server arguments on ``command``, when ``argv`` needs them (importing is slow)."""
    helping = any(token in ("-h", "--help") for token in argv)
    if wants_sglang(argv) or (helping and sglang_installed()):
        command.set_defaults(sglang_options=add_sglang_options(command, argv))
        return
    command.set_defaults(sglang_options=None)
    if helping:
        command.add_argument_group(
            "SGLang's server arguments (with --engine sglang): every flag of python -m "
            "sglang.launch_server. Not listed: SGLang is not installed here"
        )


def _add_dynamo_worker(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    worker = commands.add_parser(
        "dynamo-worker",
        help="a backend of NVIDIA Dynamo's runtime: its frontend and router send the requests, "
        "a client leaving cancels (the dynamo extra)",
        formatter_class=_HelpFormatter,
    )
    add_dynamo_worker_options(worker)
    _add_engine_option(worker)
    _add_loop_option(
        worker,
        "how trio shares the thread with the runtime's (and SGLang's) asyncio code: guest "
        "(trio as the guest of uvloop, which runs it at full speed) or trio-asyncio (trio "
        "as the host; the asyncio extra) (default: guest)",
    )
    _add_shutdown_options(
        worker,
        "at shutdown the worker leaves discovery, then open streams get this to finish; then "
        "pending engine-side cleanup gets it again",
    )
    _add_sim_options(worker)
    worker.set_defaults(disaggregation_mode=None)
    return worker


#: ``serve``'s bounds. ``--api-key`` is written out: its default is the environment's.
_LIMITS = FieldOptions(
    ServerLimits,
    kept=("api_key",),
    metavars=dict.fromkeys(("allowed_hosts", "allowed_bootstrap_hosts"), "HOST"),
)
#: The shutdown's bounds; the others bound one request's cleanup, for embedders.
_POLICY = FieldOptions(
    AbortPolicy,
    kept=(
        "close_timeout",
        "release_timeout",
        "dispatch_timeout",
        "abort_attempts",
        "outputs_after_abort",
        "abort_retry_delay",
        "abort_timeout",
        "child_watch_timeout",
        "cleanup_timeout",
        "stall_timeout",
    ),
)
#: A disaggregated SimEngine's timing; the prefill side's wait for a handshake
#: has had no option: it keeps SGLang's 300 s.
_SIM_DISAGG = FieldOptions(SimDisaggTiming, prefix="sim_", kept=("bootstrap_timeout",))


def _add_limits(serve: argparse.ArgumentParser) -> None:
    """What a client can make the server hold, and the shutdown: every bound with its default."""
    _LIMITS.add(
        serve.add_argument_group("connections (seconds, or counts)"),
        "max_connections",
        "keep_alive_timeout",
        "request_read_timeout",
        "client_stall_timeout",
        "max_unsent_tokens",
        "http2",
        "sse_heartbeat",
        "max_sse_heartbeats_per_second",
    )
    _LIMITS.add(
        serve.add_argument_group("requests (refused before they reach the engine)"),
        "max_body_bytes",
        "max_running_requests",
        "max_children_per_request",
        "max_rid_length",
        "context_length",
    )
    access = serve.add_argument_group("access")
    access.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every route but /health, a prefill "
        f"server's KV rooms included; a decode server sends it to its --prefill-url server "
        f"too (default: ${API_KEY_ENV} if set, else none)",
    )
    _LIMITS.add(access, "allowed_hosts", "allowed_bootstrap_hosts")
    _add_shutdown_options(
        serve,
        "at shutdown, open responses end and their connections get 1 s to close (then they "
        "are reset); then pending engine-side cleanup gets this",
    )


def _add_sim_options(parser: argparse.ArgumentParser) -> None:
    """The SimEngine's timing, for every command that runs it."""
    sim = parser.add_argument_group("SimEngine timing (in seconds, but the chunk size in tokens)")
    sim.add_argument(
        "--sim-tokenize-delay",
        type=seconds,
        default=0.005,
        help="from a request's arrival to the end of its tokenization",
    )
    sim.add_argument(
        "--sim-dispatch-delay",
        type=seconds,
        default=0.001,
        help="from the end of tokenization to the push to the scheduler, per child of a batch",
    )
    sim.add_argument(
        "--sim-first-token-delay",
        type=seconds,
        default=0.05,
        help="from the push to the scheduler to the first token: queueing and prefill",
    )
    sim.add_argument("--sim-token-interval", type=seconds, default=0.02, help="between two tokens")
    _SIM_DISAGG.add(
        sim,
        "prefill_time_per_token",
        "prefill_chunk_tokens",
        "bootstrap_delay",
        "kv_transfer_delay",
        "kv_wait_timeout",
    )


def _add_shutdown_options(parser: argparse.ArgumentParser, grace: str) -> None:
    _POLICY.add(
        parser.add_argument_group("shutdown (seconds; a second SIGINT/SIGTERM: at once)"),
        "shutdown_grace",
        "engine_close_timeout",
        helps={"shutdown_grace": grace},
    )


def server_limits(args: argparse.Namespace) -> ServerLimits:
    return _LIMITS.build(args, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)


def abort_policy(args: argparse.Namespace) -> AbortPolicy:
    return _POLICY.build(args)


def engine_options(args: argparse.Namespace, *, peer_api_key: str | None = None) -> EngineOptions:
    options = args.sglang_options
    mode = args.disaggregation_mode
    return EngineOptions(
        kind=args.engine,
        # SGLang's own flag says "null" for an aggregated server (dynamo-worker takes it so).
        disaggregation_mode=mode if mode in ("prefill", "decode") else None,
        sglang_args={} if options is None else options.server_args(args),
        sim_args={
            "tokenize_delay": args.sim_tokenize_delay,
            "dispatch_delay": args.sim_dispatch_delay,
            "first_token_delay": args.sim_first_token_delay,
            "token_interval": args.sim_token_interval,
            "disagg_timing": _SIM_DISAGG.build(args),
        },
        peer_api_key=peer_api_key,
    )
