"""SGLang's scheduler, missing the first abort of every request (SGLang issue #36876).

The scheduler marks an abort only on the requests it finds in its running or
last batch, so one moving between batches is missed and decodes on; in
production it left 182 requests decoding for nobody on one pod in 9 hours.
Here the fault is made certain: ``Scheduler.abort_request`` lets each
request's first abort pass it by (and says so on its standard error), and takes every later one.
From 0.5.20 SGLang's TokenizerManager sends one abort per request, so a
server that relies on it leaves every cancelled request decoding to its end.

``install()`` patches the scheduler's class as its module is imported, in a
process whose environment has ``MISS_FIRST_ABORT`` set. SGLang's scheduler
is a process of its own, started by ``multiprocessing``'s spawn, which
imports the parent's main script again (``_http_servers_cpu.py``, which
calls ``install()`` at import) and inherits its environment.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["MISSED", "MISS_FIRST_ABORT", "install"]

#: Set (to anything) in the environment: the scheduler misses each request's first abort.
MISS_FIRST_ABORT = "TRIO_SGLANG_MISS_FIRST_ABORT"
#: What the scheduler logs for each abort it missed.
MISSED = "injected fault: the scheduler missed the first abort of"

_MODULE = "sglang.srt.managers.scheduler"


def install() -> None:
    """Patch SGLang's scheduler when it loads, if ``MISS_FIRST_ABORT`` is set; idempotent."""
    if not os.environ.get(MISS_FIRST_ABORT):
        return
    if _MODULE in sys.modules:
        _miss_first_aborts(sys.modules[_MODULE])
    elif not any(isinstance(finder, _PatchOnLoad) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnLoad())


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Finds the scheduler's module as the path finder does, and patches it once it ran."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _miss_first_aborts(module)

        loader.exec_module = exec_module
        return spec


def _miss_first_aborts(module: ModuleType) -> None:
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
