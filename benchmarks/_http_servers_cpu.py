"""An HTTP server on the whole SGLang engine, on this CPU: SGLang's own, or trio-sglang's.

    python benchmarks/_http_servers_cpu.py [--slow-tokenize S] [--miss-first-abort]
        {sglang,trio-sglang} -- FLAGS...

What ``cancel_latency.py --engine sglang-engine`` sets side by side, each over
its own ``sglang.Engine`` on the tiny model: SGLang 0.5.23's ``launch_server``
(its FastAPI app, its disconnect handling; started from ``prepare_server_args``
on the flags after ``--``, with trio-sglang's CPU defaults under them, as
SGLang's own flags), and ``trio-sglang serve --engine sglang --device cpu``
(the flags after ``--`` are serve's). SGLang's CPU engine is prepared as
trio-sglang prepares it, before SGLang is imported. One change to both, so
that a client can leave during a slow tokenization as in the harness's phases:
a prompt that starts with ``SLOW_PROMPT`` is tokenized ``--slow-tokenize``
seconds late, in SGLang's own TokenizerManager. With ``--miss-first-abort``,
one more: SGLang's scheduler misses the first abort of every request
(``_missed_aborts.py``), for both servers alike. And for a prefill/decode
pair over Mooncake, its KV sender takes the plain path a CPU can run
(``_cpu_kv_transfer.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import _cpu_kv_transfer
from _missed_aborts import MISS_FIRST_ABORT, install
from trio_sglang._sglang._cpu import CPU_DEFAULTS, prepare_cpu_engine

__all__ = ["SLOW_PROMPT", "cpu_flags", "main", "slow_down"]

#: A prompt that starts so is tokenized late (``--slow-tokenize``).
SLOW_PROMPT = "slowly: "

# Here too in SGLang's scheduler process, whose spawn imports this script again.
install()
_cpu_kv_transfer.install()


def cpu_flags() -> list[str]:
    """``CPU_DEFAULTS`` as SGLang's own command-line flags."""
    flags: list[str] = []
    for name, value in CPU_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def slow_down(delay: float) -> None:
    """From now on, SGLang tokenizes a prompt that starts with ``SLOW_PROMPT`` ``delay`` s late."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    original = TokenizerManager._tokenize_one_request

    async def tokenize(self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(obj.text, str) and obj.text.startswith(SLOW_PROMPT):
            await asyncio.sleep(delay)
        return await original(self, obj, *args, **kwargs)

    TokenizerManager._tokenize_one_request = tokenize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="_http_servers_cpu.py", description=__doc__)
    parser.add_argument("server", choices=["sglang", "trio-sglang"])
    parser.add_argument("--slow-tokenize", type=float, default=0.5, help="seconds")
    parser.add_argument(
        "--miss-first-abort",
        action="store_true",
        help="SGLang's scheduler misses the first abort of every request (issue #36876)",
    )
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="the server's flags, after --")
    args = parser.parse_args(argv)
    flags = [flag for flag in args.flags if flag != "--"]
    prepare_cpu_engine()
    slow_down(args.slow_tokenize)
    if args.miss_first_abort:
        os.environ[MISS_FIRST_ABORT] = "1"  # for the scheduler process, which inherits it
        install()
    if args.server == "trio-sglang":
        from trio_sglang._cli._main import main as trio_sglang

        return trio_sglang(["serve", "--engine", "sglang", "--device", "cpu", *flags])
    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args

    run_server(prepare_server_args(["--device", "cpu", *cpu_flags(), *flags]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
