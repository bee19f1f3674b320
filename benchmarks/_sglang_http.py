"""An HTTP server on the real TokenizerManager and the stand-in scheduler: SGLang's, or ``serve``.

    python benchmarks/_sglang_http.py --workdir DIR --token-interval S \
        [--first-token-delay S] [--slow-tokenize S] [--server {sglang,trio-sglang,hosted}] \
        [--loop {guest,trio-asyncio}]

What ``serve_throughput.py --sglang`` measures beside ``serve`` and the floor
(docs/benchmarks.md, "SGLang's own HTTP server"), and what
``release_servers.py`` compares on each SGLang release. ``--server sglang`` is
started as ``launch_server`` starts it (``_setup_and_run_http_server``);
``trio-sglang`` is ``serve`` over ``SGLangEngine`` with its own routes, and
``hosted`` the same with SGLang's server application hosted (``serve --engine
sglang``'s way), on trio as uvloop's guest or in trio-asyncio (``--loop``).
The stand-in scheduler (``trio_sglang_harness.open_tokenizer_manager``) sends
a token every ``--token-interval`` s per request, already detokenized, and
logs what it did to ``DIR/scheduler-*.jsonl``.

A prompt that starts with ``_http_servers_cpu.SLOW_PROMPT`` is tokenized
``--slow-tokenize`` s late. SGLang's server also answers ``GET
/trio_sglang/states`` with ``{"states": N}``, the size of its TokenizerManager's
``rid_to_state``. It prints ``serving {sglang,trio-sglang,hosted} on URL`` once
it answers (the line ``_load_server`` waits for), and stops on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

from _http_servers_cpu import slow_down
from _subprocesses import free_port, healthy, wait_until
from trio_sglang_harness import HostedTokenizerManager, open_tokenizer_manager

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="_sglang_http.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--token-interval", type=float, required=True, help="seconds")
    parser.add_argument("--first-token-delay", type=float, default=0.0, help="seconds")
    parser.add_argument("--slow-tokenize", type=float, default=0.5, help="seconds")
    parser.add_argument("--server", choices=["sglang", "trio-sglang", "hosted"], default="sglang")
    parser.add_argument("--loop", choices=["guest", "trio-asyncio"], default="guest")
    args = parser.parse_args(argv)
    slow_down(args.slow_tokenize)
    with open_tokenizer_manager(
        args.workdir,
        first_token_delay=args.first_token_delay,
        token_interval=args.token_interval,
    ) as hosted:
        if args.server == "sglang":
            _sglang_server(hosted)
        else:
            _serve(hosted, host_app=args.server == "hosted", loop=args.loop)
    return 0


def _serve(hosted: HostedTokenizerManager, *, host_app: bool, loop: str) -> None:
    import asyncio

    import trio

    from trio_sglang import SGLangEngine, run_as_guest
    from trio_sglang.server import serve

    port = free_port()
    tm = hosted.tokenizer_manager
    templates = {}
    if host_app:
        _configure(tm, port)
        templates["template_manager"] = hosted.templates

    async def run(host: asyncio.AbstractEventLoop | None) -> None:
        engine = SGLangEngine(tokenizer_manager=tm, asyncio_loop=host, **templates)
        async with trio.open_nursery() as nursery:
            start = partial(serve, engine, host="127.0.0.1", port=port, host_app=host_app)
            (url,) = await nursery.start(start)
            if host_app:  # as SGLang's server does once up (see announce below)
                await trio.to_thread.run_sync(_freeze_gc, url)
            print(f"INFO serving {'hosted' if host_app else 'trio-sglang'} on {url}", flush=True)

    if loop == "guest":
        run_as_guest(run)
    else:
        trio.run(run, None)


def _configure(tm: Any, port: int) -> None:
    """SGLang's server arguments: ``port``, and no warm-up request (the benchmark warms
    every server up alike)."""
    try:
        from sglang.srt.runtime_context import get_context
    except ImportError:
        override = None
    else:
        override = getattr(get_context(), "override", None)
    if override is not None:
        # Resolved config, changed as SGLang lets a runner change it.
        override("serve_throughput", port=port, skip_server_warmup=True)
    # Releases up to 0.5.17 read both from their ServerArgs: read-only in 0.5.17,
    # which changes them through an override of their own, plain fields before.
    args_override = getattr(tm.server_args, "override", None)
    if args_override is not None:
        args_override("serve_throughput", port=port, skip_server_warmup=True)
    elif override is None:
        tm.server_args.port, tm.server_args.skip_server_warmup = port, True


def _sglang_server(hosted: HostedTokenizerManager) -> None:
    # Imported here, once the start-up has told the hub libraries to stay offline.
    from sglang.srt.entrypoints import http_server

    tm = hosted.tokenizer_manager
    port = free_port()
    _configure(tm, port)

    def states() -> dict[str, Any]:
        return {"states": len(tm.rid_to_state)}

    http_server.app.add_api_route("/trio_sglang/states", states, methods=["GET"])

    def announce() -> None:
        # What SGLang does after its warm-up (which asked its default port): freeze
        # what the start-up allocated, so that full collections skip it. Releases
        # before 0.5.17 call this without a warm-up before uvicorn listens.
        url = f"http://127.0.0.1:{port}"
        wait_until(f"SGLang's server on {url} to answer", lambda: healthy(url, timeout=2), 60)
        _freeze_gc(url)
        print(f"INFO serving sglang on {url}", flush=True)

    http_server._setup_and_run_http_server(
        tm.server_args,
        tm,
        hosted.templates,
        hosted.port_args,
        [{}],
        None,
        launch_callback=announce,
    )


def _freeze_gc(url: str) -> None:
    request = urllib.request.Request(f"{url}/freeze_gc", method="POST")
    with urllib.request.urlopen(request, timeout=30):
        pass


if __name__ == "__main__":
    sys.exit(main())
