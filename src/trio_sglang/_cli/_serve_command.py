"""``trio-sglang serve``: its checks of the command line, then the engine and the server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import importlib.util
import logging
import resource
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from .._asyncio_bridge._guest import run_beside_asyncio
from .._core._disagg import PrefillFailed
from .._limits import ServerLimits
from .._sglang._semantics import UnsupportedSGLang
from .._sglang._server_args import refused_flag
from ._engines import open_engine
from ._exits import first, forced_status, refuse
from ._parser import abort_policy, engine_options, server_limits

if TYPE_CHECKING:
    from ..server import HTTPPrefill

__all__ = ["run_serve"]

#: What ``serve`` takes as "shut down" (and, a second time, "now").
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Descriptors left for everything but client connections: the engine, the
#: listeners, logs, the prefill peer's connections.
_DESCRIPTORS_KEPT = 128


def run_serve(args: argparse.Namespace) -> int:
    logging.getLogger("trio_sglang").setLevel(logging.INFO)
    try:
        from ..server import ForcedShutdown, HTTPPrefill, ListenError
    except ImportError as exc:
        return refuse(
            f"trio-sglang serve needs the serve extra: pip install 'trio-sglang[serve]' ({exc})"
        )
    if args.engine == "sglang":
        if not args.model_path:
            return refuse("--engine sglang needs --model-path")
        if args.loop == "trio-asyncio" and importlib.util.find_spec("trio_asyncio") is None:
            return refuse(
                "--loop trio-asyncio needs trio-asyncio: pip install 'trio-sglang[asyncio]'"
            )
        if args.sglang_options is not None:
            refused = refused_flag(args.sglang_options.server_args(args))
            if refused is not None:
                return refuse(refused)
    elif args.chat_template is not None:
        return refuse("--chat-template goes with --engine sglang")
    elif args.loop is not None:
        return refuse("--loop goes with --engine sglang: the SimEngine runs no asyncio code")
    if args.prefill_url is not None and args.disaggregation_mode != "decode":
        return refuse("--prefill-url is for a decode worker: add --disaggregation-mode decode")
    if args.prefill_bootstrap_port is not None and args.prefill_url is None:
        return refuse("--prefill-bootstrap-port goes with --prefill-url")
    try:
        limits = _fit_to_descriptors(server_limits(args))
    except ValueError as exc:  # an allow-list entry that is no host
        return refuse(f"trio-sglang serve: {exc}")
    prefill = None
    if args.prefill_url is not None:
        try:
            prefill = HTTPPrefill(
                args.prefill_url, bootstrap_port=args.prefill_bootstrap_port, api_key=limits.api_key
            )
        except ValueError as exc:
            return refuse(f"--prefill-url: {exc}")
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
        refusal = f"the prefill server is not usable: {first(failed)}"
    except* ListenError as failed:  # a port in use, an address not on this machine
        refusal = str(first(failed))
    except* UnsupportedSGLang as old:  # an SGLang release older than the minimum
        refusal = str(first(old))
    except* ForcedShutdown as stopped:
        forced = forced_status(stopped)
    if refusal is not None:
        return refuse(refusal)
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
        options = engine_options(args, peer_api_key=limits.api_key)
        engine, hosted = await stack.enter_async_context(open_engine(options, asyncio_loop=loop))
        if prefill is not None:
            await stack.enter_async_context(prefill)
        await serve(
            engine,
            host=args.host,
            port=args.port,
            model=args.served_model_name or _default_model_name(args),
            policy=abort_policy(args),
            limits=limits,
            prefill=prefill,
            kv_rooms=hosted,
            enable_cache_report=args.enable_cache_report,
            # SGLang's own server application, its routes over the lifecycle.
            host_app=args.engine == "sglang",
        )


def _default_model_name(args: argparse.Namespace) -> str:
    if args.engine == "sglang":
        return Path(args.model_path).name
    return "trio-sglang-sim"
