"""``InProcessPrefill``: a prefill worker in the same trio run, as a decode worker's peer.

Kept apart from ``_disagg.py`` because it drives a ``Worker``: the lifecycle
knows its prefill peer only through the ``PrefillPeer`` protocol, and this
adapter sits on top of the lifecycle, as ``server.HTTPPrefill`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from ._context import RequestContext
from ._disagg import PrefillFailed
from ._outputs import finish_reason_type
from ._worker import Worker

__all__ = ["InProcessPrefill"]


class InProcessPrefill:
    """A prefill worker in this trio run (tests, benchmarks, one-process pairs)."""

    def __init__(
        self, worker: Worker, *, bootstrap_host: str = "127.0.0.1", bootstrap_port: int = 8998
    ) -> None:
        self.name = f"in-process {worker.engine!r}"
        self.bootstrap_host = bootstrap_host
        self.bootstrap_port = bootstrap_port
        self._worker = worker

    async def capabilities(self) -> Mapping[str, Any]:
        await trio.lowlevel.checkpoint()
        return self._worker.capabilities()

    async def prefill(self, request: Mapping[str, Any], public_id: str) -> None:
        reason: object = None
        ctx = RequestContext(public_id)
        async with self._worker.generate(request, ctx, output="native") as outputs:
            async for out in outputs:
                reason = out["meta_info"]["finish_reason"]
        if finish_reason_type(reason) != "length":
            raise PrefillFailed(f"the prefill worker ended the leg with {reason!r}")
