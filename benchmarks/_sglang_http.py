"""SGLang's own HTTP server on a CPU: its app and TokenizerManager, over the stand-in scheduler.

    python benchmarks/_sglang_http.py --workdir DIR --token-interval S [--first-token-delay S]

What ``serve_throughput.py --sglang`` measures beside ``serve`` and the floor.
SGLang 0.5.23's own server, started as ``launch_server`` starts it
(``_setup_and_run_http_server``: its FastAPI app, its OpenAI handlers, its
warm-up, uvicorn on uvloop), with the real ``TokenizerManager`` built as the
GPU-free harness builds it (``trio_sglang.harness.open_tokenizer_manager``)
and the harness's stand-in scheduler in place of the GPU scheduler and the
detokenizer: a process of its own, whose CPU is not the server's, as a GPU
scheduler's is not. The stand-in sends a token every ``--token-interval`` s
per request, already detokenized, as SGLang's detokenizer would.

It prints ``serving sglang on http://HOST:PORT`` once SGLang's warm-up is
done (the line ``_load_server`` waits for; ``/health`` answers from then
on), and stops on SIGINT or SIGTERM. Needs the ``sglang`` extra, and what
SGLang's HTTP server imports beside it (``soundfile``, ``python-multipart``).
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from pathlib import Path

from _subprocesses import free_port
from trio_sglang.harness import open_tokenizer_manager

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="_sglang_http.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--token-interval", type=float, required=True, help="seconds")
    parser.add_argument("--first-token-delay", type=float, default=0.0, help="seconds")
    args = parser.parse_args(argv)
    with open_tokenizer_manager(
        args.workdir,
        first_token_delay=args.first_token_delay,
        token_interval=args.token_interval,
    ) as hosted:
        # Imported here, once the start-up has told the hub libraries to stay offline.
        from sglang.srt.entrypoints import http_server
        from sglang.srt.runtime_context import get_context

        # The port, and no warm-up request (the benchmark warms every server up alike):
        # resolved config, changed as SGLang lets a runner change it.
        port = free_port()
        get_context().override("serve_throughput", port=port, skip_server_warmup=True)

        def announce() -> None:
            # What SGLang does after its warm-up (which asked its default port): freeze
            # what the start-up allocated, so that full collections skip it.
            url = f"http://127.0.0.1:{port}"
            with urllib.request.urlopen(urllib.request.Request(f"{url}/freeze_gc", method="POST")):
                pass
            print(f"INFO serving sglang on {url}", flush=True)

        tm = hosted.tokenizer_manager
        http_server._setup_and_run_http_server(
            tm.server_args,
            tm,
            hosted.templates,
            hosted.port_args,
            [{}],
            None,
            launch_callback=announce,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
