"""SGLang's own HTTP server on a CPU: its app and TokenizerManager, over the stand-in scheduler.

    python benchmarks/_sglang_http.py --workdir DIR --token-interval S [--first-token-delay S]

What ``serve_throughput.py --sglang`` measures beside ``serve`` and the floor.
SGLang 0.5.23's own server, started as ``launch_server`` starts it
(``_setup_and_run_http_server``: its FastAPI app, its OpenAI handlers, its
warm-up, uvicorn on uvloop), with the real ``TokenizerManager`` built as the
GPU-free harness builds it (``trio_sglang.harness``) and the harness's
stand-in scheduler in place of the GPU scheduler and the detokenizer: a
process of its own, whose CPU is not the server's, as a GPU scheduler's is
not. The stand-in sends a token every ``--token-interval`` s per request,
already detokenized, as SGLang's detokenizer would.

It prints ``serving sglang on http://HOST:PORT`` once SGLang's warm-up is
done (the line ``_load_server`` waits for; ``/health`` answers from then
on), and stops on SIGINT or SIGTERM. Needs the ``sglang`` extra, and what
SGLang's HTTP server imports beside it (``soundfile``, ``python-multipart``).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from trio_sglang.harness import build_tiny_model
from trio_sglang.harness._host import _tokenizer_manager, _wait_until_ready

__all__ = ["main"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="_sglang_http.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--token-interval", type=float, required=True, help="seconds")
    parser.add_argument("--first-token-delay", type=float, default=0.0, help="seconds")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sglang.srt.entrypoints import http_server
    from sglang.srt.runtime_context import get_context

    model = build_tiny_model(args.workdir / "tiny-llama")
    tm, templates, port_args = _tokenizer_manager(model, None, None)
    # The port, and no warm-up request (the benchmark warms every server up alike):
    # resolved config, changed as SGLang lets a runner change it.
    port = _free_port()
    get_context().override("serve_throughput", port=port, skip_server_warmup=True)
    log = args.workdir / f"scheduler-{os.getpid()}.jsonl"
    log.write_bytes(b"")
    scheduler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trio_sglang.harness._scheduler",
            *("--input", port_args.scheduler_input_ipc_name),
            *("--output", port_args.tokenizer_ipc_name),
            *("--first-token-delay", str(args.first_token_delay)),
            *("--token-interval", str(args.token_interval)),
            *("--log", str(log)),
        ]
    )
    try:
        _wait_until_ready(scheduler, log)

        def announce() -> None:
            # What SGLang does after its warm-up (which asked its default port): freeze
            # what the start-up allocated, so that full collections skip it.
            url = f"http://127.0.0.1:{port}"
            with urllib.request.urlopen(urllib.request.Request(f"{url}/freeze_gc", method="POST")):
                pass
            print(f"INFO serving sglang on {url}", flush=True)

        http_server._setup_and_run_http_server(
            tm.server_args, tm, templates, port_args, [{}], None, launch_callback=announce
        )
    finally:
        scheduler.terminate()
        try:
            scheduler.wait(timeout=5)
        except subprocess.TimeoutExpired:
            scheduler.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
