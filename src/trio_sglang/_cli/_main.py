"""``trio-sglang`` on the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import importlib.util
import logging
import os
import resource
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from .._asyncio_bridge._asyncio_side import LOOP_KINDS
from .._asyncio_bridge._guest import run_beside_asyncio
from .._core._disagg import PrefillFailed
from .._core._policy import AbortPolicy
from .._limits import API_KEY_ENV, ServerLimits
from .._sglang._semantics import UnsupportedSGLang
from .._sglang._server_args import add_sglang_options, refused_flag, sglang_installed, wants_sglang
from .._version import __version__
from ..bench_endpoint._options import add_options as add_bench_endpoint_options
from ..sim import SimDisaggTiming
from ._demo import run_demo
from ._engines import EngineOptions, open_engine
from ._field_options import FieldOptions, positive_int, seconds

#: What ``serve`` takes as "shut down" (and, a second time, "now").
_SIGNALS = (signal.SIGINT, signal.SIGTERM)

if TYPE_CHECKING:
    from ..server import HTTPPrefill

__all__ = ["main"]


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port in [1, 65535], got {value}")
    return value


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
        type=_port,
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
    worker.add_argument("--model-name", required=True, help="the model's name at Dynamo's frontend")
    worker.add_argument("--namespace", default="dynamo", help="the endpoint's Dynamo namespace")
    worker.add_argument("--component", default="backend", help="the endpoint's component")
    worker.add_argument("--endpoint", default="generate", help="the endpoint's name")
    _add_engine_option(worker)
    worker.add_argument(
        "--model-input",
        choices=["tokens", "text"],
        default="tokens",
        help="what the frontend sends: tokens (Dynamo's ModelInput.Tokens: the frontend "
        "tokenizes with the model's tokenizer and chat template, and its KV router works) or "
        "text (ModelInput.Text: the worker gets the client's OpenAI request, renders chat with "
        "the engine's own template and tokenizes; no tokenizer at the frontend)",
    )
    worker.add_argument(
        "--model-path",
        help="the model's folder: with --model-input tokens the frontend tokenizes with its "
        "tokenizer and chat template (default: the SimEngine's own tiny tokenizer; --engine "
        "sglang needs one)",
    )
    _add_loop_option(
        worker,
        "how trio shares the thread with the runtime's (and SGLang's) asyncio code: guest "
        "(trio as the guest of uvloop, which runs it at full speed) or trio-asyncio (trio "
        "as the host; the asyncio extra) (default: guest)",
    )
    worker.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of the --metrics-port server"
    )
    worker.add_argument(
        "--metrics-port",
        type=int,
        help="serve GET /metrics (the trio_sglang_* metrics of serve) on this port; 0 picks "
        "a free one (default: none)",
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


def _server_limits(args: argparse.Namespace) -> ServerLimits:
    return _LIMITS.build(args, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)


#: How a shell reports a program that SIGPIPE ended (128 + 13), as ``demo | head`` expects.
_BROKEN_PIPE_STATUS = 141
#: Descriptors left for everything but client connections: the engine, the
#: listeners, logs, the prefill peer's connections.
_DESCRIPTORS_KEPT = 128


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_sglang(argv) and not sglang_installed():
        return _refuse(
            "--engine sglang needs SGLang: pip install 'trio-sglang[sglang]' (a GPU machine), "
            "or SGLang's CPU-importable parts (docs/engines.md; nox -s real-engine installs them)"
        )
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        commands = {
            "demo": _demo,
            "serve": _serve,
            "dynamo-worker": _dynamo_worker,
            "bench-endpoint": _bench_endpoint,
        }
        status = commands[args.command](args)
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


def _bench_endpoint(args: argparse.Namespace) -> int:
    try:
        from ..bench_endpoint._command import Refused, printable, run_command
    except ImportError as exc:
        return _refuse(
            "trio-sglang bench-endpoint needs the bench extra: "
            f"pip install 'trio-sglang[bench]' ({exc})"
        )
    refusal = ""
    try:
        return run_command(args)
    except* Refused as refused:
        refusal = printable(str(_first(refused)))
    return _refuse(refusal)


def _dynamo_worker(args: argparse.Namespace) -> int:
    logging.getLogger("trio_sglang").setLevel(logging.INFO)
    try:
        from ..dynamo._serve import RuntimeStopped
        from ..dynamo._worker_command import Refused, run_command
    except ImportError as exc:
        return _refuse(
            "trio-sglang dynamo-worker needs the dynamo extra: "
            f"pip install 'trio-sglang[dynamo]' ({exc})"
        )
    from ..server import ForcedShutdown

    refusal: str | None = None
    lost: str | None = None
    forced: int | None = None
    try:
        run_command(args, _engine_options(args))
    except* Refused as refused:
        refusal = f"trio-sglang dynamo-worker: {_first(refused)}"
    except* UnsupportedSGLang as old:
        refusal = f"trio-sglang dynamo-worker: {_first(old)}"
    except* RuntimeStopped as stopped_serving:
        lost = f"trio-sglang dynamo-worker: {_first(stopped_serving)}"
    except* ForcedShutdown as stopped:
        forced = _forced_status(stopped)
    if refusal is not None:
        return _refuse(refusal)
    if lost is not None:  # not the configuration's fault: exit 1, for a supervisor to restart it
        print(lost, file=sys.stderr)
        return 1
    return 0 if forced is None else forced


def _serve(args: argparse.Namespace) -> int:
    logging.getLogger("trio_sglang").setLevel(logging.INFO)
    try:
        from ..server import ForcedShutdown, HTTPPrefill, ListenError
    except ImportError as exc:
        return _refuse(
            f"trio-sglang serve needs the serve extra: pip install 'trio-sglang[serve]' ({exc})"
        )
    if args.engine == "sglang":
        if not args.model_path:
            return _refuse("--engine sglang needs --model-path")
        if args.loop == "trio-asyncio" and importlib.util.find_spec("trio_asyncio") is None:
            return _refuse(
                "--loop trio-asyncio needs trio-asyncio: pip install 'trio-sglang[asyncio]'"
            )
        if args.sglang_options is not None:
            refused = refused_flag(args.sglang_options.server_args(args))
            if refused is not None:
                return _refuse(refused)
    elif args.chat_template is not None:
        return _refuse("--chat-template goes with --engine sglang")
    elif args.loop is not None:
        return _refuse("--loop goes with --engine sglang: the SimEngine runs no asyncio code")
    if args.prefill_url is not None and args.disaggregation_mode != "decode":
        return _refuse("--prefill-url is for a decode worker: add --disaggregation-mode decode")
    if args.prefill_bootstrap_port is not None and args.prefill_url is None:
        return _refuse("--prefill-bootstrap-port goes with --prefill-url")
    try:
        limits = _fit_to_descriptors(_server_limits(args))
    except ValueError as exc:  # an allow-list entry that is no host
        return _refuse(f"trio-sglang serve: {exc}")
    prefill = None
    if args.prefill_url is not None:
        try:
            prefill = HTTPPrefill(
                args.prefill_url, bootstrap_port=args.prefill_bootstrap_port, api_key=limits.api_key
            )
        except ValueError as exc:
            return _refuse(f"--prefill-url: {exc}")
    # Everything imported so far lives as long as the process: out of the
    # collector's sight, a full collection under load walks far fewer objects
    # (its pauses are what a disconnect waits for at p99).
    gc.freeze()
    # The first two come at startup, nested in nurseries; the last after a
    # second signal, once all is closed. Anything else goes on up as it is.
    refusal: str | None = None
    forced: int | None = None
    try:
        if args.engine == "sglang":
            run_beside_asyncio(args.loop or "guest", _serve_until_stopped, args, limits, prefill)
        else:
            trio.run(_serve_until_stopped, None, args, limits, prefill)
    except* PrefillFailed as failed:  # the prefill server's first check
        refusal = f"the prefill server is not usable: {_first(failed)}"
    except* ListenError as failed:  # a port in use, an address not on this machine
        refusal = str(_first(failed))
    except* UnsupportedSGLang as old:  # an SGLang release older than the minimum
        refusal = str(_first(old))
    except* ForcedShutdown as stopped:
        forced = _forced_status(stopped)
    if refusal is not None:
        return _refuse(refusal)
    return 0 if forced is None else forced


def _fit_to_descriptors(limits: ServerLimits) -> ServerLimits:
    """Raise the soft file-descriptor limit to the hard one (as SGLang's server does).

    Then lower ``max_connections`` to what it leaves, so that a flood of
    clients waits in the kernel's queue instead of starving the engine, the
    logs and ``/health`` of descriptors.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # a hard limit past the kernel's cap
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    fits = max(1, soft - _DESCRIPTORS_KEPT)
    if soft == resource.RLIM_INFINITY or limits.max_connections <= fits:
        return limits
    logging.getLogger("trio_sglang.server").warning(
        "--max-connections %d lowered to %d to fit the file-descriptor limit (%d)",
        limits.max_connections,
        fits,
        soft,
    )
    return dataclasses.replace(limits, max_connections=fits)


def _forced_status(stopped: BaseExceptionGroup[BaseException]) -> int:
    """The exit status after a second signal: 128 + its number, as a shell reports it."""
    from ..server import ForcedShutdown

    found = _first(stopped)
    assert isinstance(found, ForcedShutdown)
    return 128 + found.signum


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception a (nested) group holds."""
    found: BaseException = group
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    return found


async def _serve_until_stopped(
    loop: asyncio.AbstractEventLoop | None,
    args: argparse.Namespace,
    limits: ServerLimits,
    prefill: HTTPPrefill | None,
) -> None:
    """The engine, and what one side of a disaggregated pair needs, around the server.

    ``loop``: the asyncio loop this run is the guest of, where SGLang runs
    (``None``: none, or trio-asyncio's inside the run).

    From here to the process's exit no SIGINT or SIGTERM meets Python's default
    handler (a traceback, or death by SIGTERM with the wrong status): ``serve``
    takes them while it runs; an outer receiver, never read, takes those that
    come before or after it; and when that closes it leaves what it found,
    both ignored, for the interpreter's exit. Set with no checkpoint between,
    there is no moment without one or the other.
    """
    for signum in _SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    with trio.open_signal_receiver(*_SIGNALS):
        await _run_server(loop, args, limits, prefill)


async def _run_server(
    loop: asyncio.AbstractEventLoop | None,
    args: argparse.Namespace,
    limits: ServerLimits,
    prefill: HTTPPrefill | None,
) -> None:
    from ..server import serve

    async with contextlib.AsyncExitStack() as stack:
        options = _engine_options(args, peer_api_key=limits.api_key)
        engine, hosted = await stack.enter_async_context(open_engine(options, asyncio_loop=loop))
        if prefill is not None:
            await stack.enter_async_context(prefill)
        await serve(
            engine,
            host=args.host,
            port=args.port,
            model=args.served_model_name or _default_model_name(args),
            policy=_POLICY.build(args),
            limits=limits,
            prefill=prefill,
            kv_rooms=hosted,
            enable_cache_report=args.enable_cache_report,
            # SGLang's own server application, its routes over the lifecycle.
            host_app=args.engine == "sglang",
        )


def _engine_options(args: argparse.Namespace, *, peer_api_key: str | None = None) -> EngineOptions:
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


def _default_model_name(args: argparse.Namespace) -> str:
    if args.engine == "sglang":
        return Path(args.model_path).name
    return "trio-sglang-sim"
