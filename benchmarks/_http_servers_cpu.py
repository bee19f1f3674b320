"""An HTTP server on the whole SGLang engine, on this CPU: SGLang's own, or trio-sglang's.

    python benchmarks/_http_servers_cpu.py [--slow-tokenize S] [--miss-first-abort]
        {sglang,trio-sglang} -- FLAGS...

What ``cancel_latency.py --engine sglang-engine`` sets side by side, each over
its own ``sglang.Engine`` on the tiny model: SGLang 0.5.23's ``launch_server``
(its FastAPI app, its disconnect handling; started from ``prepare_server_args``
on the flags after ``--``, with trio-sglang's CPU defaults under them, as
SGLang's own flags), and ``trio-sglang serve --engine sglang --device cpu``
(the flags after ``--`` are serve's). SGLang's CPU engine is prepared as
trio-sglang prepares it, before SGLang is imported. Changes to both, so that
a client can leave where the harness's phases do, and SGLang's faults show:

- a prompt that starts with ``SLOW_PROMPT`` is tokenized ``--slow-tokenize``
  seconds late, in SGLang's own TokenizerManager;
- with ``--miss-first-abort``, SGLang's scheduler misses the first abort of
  every request (``MISS_FIRST_ABORT``, SGLang issue #36876);
- for a prefill/decode pair over Mooncake, its KV sender takes the plain path
  a CPU can run (``_plain_kv_indices``).

SGLang's scheduler is a process of its own, started by ``multiprocessing``'s
spawn, which imports this script again and so runs what it does at import: a
patch that must hold there is installed at import (``_patch_on_load``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from trio_sglang._sglang._cpu import CPU_DEFAULTS, prepare_cpu_engine

__all__ = ["MISSED", "SLOW_PROMPT", "main", "slow_down"]

#: A prompt that starts so is tokenized late (``--slow-tokenize``).
SLOW_PROMPT = "slowly: "
#: Set (to anything) in the environment: the scheduler misses each request's first abort.
MISS_FIRST_ABORT = "TRIO_SGLANG_MISS_FIRST_ABORT"
#: What the scheduler logs for each abort it missed.
MISSED = "injected fault: the scheduler missed the first abort of"


def _patch_on_load(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Run ``patch`` on module ``name`` once it has loaded (now, if it has); idempotent.

    A module not loaded yet is found by a finder on ``sys.meta_path`` that lets
    the path finder load it and then patches it.
    """
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(
        isinstance(finder, _PatchOnLoad) and finder.name == name for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _PatchOnLoad(name, patch))


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Finds one module as the path finder does, and patches it once it ran."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name = name
        self._patch = patch

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            self._patch(module)

        loader.exec_module = exec_module
        return spec


def _install() -> None:
    """Patch SGLang's scheduler when it loads, if ``MISS_FIRST_ABORT`` is set; idempotent."""
    if not os.environ.get(MISS_FIRST_ABORT):
        return
    _patch_on_load("sglang.srt.managers.scheduler", _miss_first_aborts)


def _miss_first_aborts(module: ModuleType) -> None:
    """Let each request's first abort pass the scheduler by (saying so on its standard error),
    and take every later one: SGLang issue #36876 made certain (docs/benchmarks.md, "When
    SGLang's scheduler misses the abort"); in production it left 182 requests decoding for
    nobody on one pod in 9 hours."""
    scheduler: Any = module.Scheduler
    if getattr(scheduler.abort_request, "misses_first", False):
        return
    take = scheduler.abort_request
    missed: set[str] = set()

    def abort_request(self: Any, recv_req: Any) -> Any:
        rid = recv_req.rid
        if rid and not recv_req.abort_all and rid not in missed:
            missed.add(rid)
            print(MISSED, rid, file=sys.stderr, flush=True)  # the process's own log
            return None
        return take(self, recv_req)

    abort_request.misses_first = True  # type: ignore[attr-defined]
    scheduler.abort_request = abort_request


def _plain_kv_indices(module: ModuleType) -> None:
    """Mooncake's KV sender on the plain path, as other backends send (docs/engines.md, the
    prefill/decode pair on a CPU): its host-tensor path records a CUDA event per KV chunk."""
    module.MooncakeKVSender.supports_host_tensor_indices = False


# Here too in SGLang's scheduler process, whose spawn imports this script again.
_install()
_patch_on_load("sglang.srt.disaggregation.mooncake.conn", _plain_kv_indices)


def _cpu_flags() -> list[str]:
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
        _install()
    if args.server == "trio-sglang":
        from trio_sglang._cli._main import main as trio_sglang

        return trio_sglang(["serve", "--engine", "sglang", "--device", "cpu", *flags])
    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args

    run_server(prepare_server_args(["--device", "cpu", *_cpu_flags(), *flags]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
