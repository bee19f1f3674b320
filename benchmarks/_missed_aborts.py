"""SGLang's scheduler, missing the first abort of every request (SGLang issue #36876).

The scheduler marks an abort only on the requests it finds in its running or
last batch, so one moving between batches is missed and decodes on; in
production it left 182 requests decoding for nobody on one pod in 9 hours.
Here the fault is made certain: ``Scheduler.abort_request`` lets each
request's first abort pass it by (and says so on its standard error), and takes every later one.
From 0.5.20 SGLang's TokenizerManager sends one abort per request, so a
server that relies on it leaves every cancelled request decoding to its end.

``install()`` patches the scheduler's class as its module is imported
(``_patch_on_load.py``), in a process whose environment has
``MISS_FIRST_ABORT`` set: SGLang's scheduler process inherits it.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

from _patch_on_load import patch_on_load

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
    patch_on_load(_MODULE, _miss_first_aborts)


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
