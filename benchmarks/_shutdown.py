"""How long leaving the worker takes with many detached aborts still pending.

The SPEC bounds it by the policy's ``shutdown_grace`` plus 50 ms. To have
cleanup that is really pending, the engine has no release path on close
(``release_on_close=False``) and tokenizes for longer than the run: every
killed stream leaves a cleanup task waiting (woken, bounded) for the
dispatch it needs before it may abort, and the worker's exit has to cancel
all of them after the grace.

As for every other cell (``_meter.py``), the collector's debt from setting up
the 1,000 streams is paid before the clock starts: a full collection of the
setup's objects is not what the worker's exit costs.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import trio

import trio_sglang as ts
from _cells import wait_events

__all__ = ["shutdown_time"]

REQUEST: dict[str, Any] = {
    "text": "shut down while I wait",
    "sampling_params": {"max_new_tokens": 8},
}


async def shutdown_time(pending: int, grace: float = 0.25) -> dict[str, Any]:
    """Leave a worker with ``pending`` cleanup tasks waiting; time the exit."""
    engine = ts.SimEngine(tokenize_delay=3600.0, release_on_close=False)
    contexts = [ts.RequestContext(f"shutdown-{index}") for index in range(pending)]

    async def consume(worker: ts.Worker, ctx: ts.RequestContext) -> None:
        async with worker.generate(REQUEST, ctx, output="tokens") as chunks:
            async for _ in chunks:
                pass

    async with ts.open_worker(engine, policy=ts.AbortPolicy(shutdown_grace=grace)) as worker:
        async with trio.open_nursery() as nursery:
            for ctx in contexts:
                nursery.start_soon(consume, worker, ctx)
            await wait_events(engine, "registered", pending)
            for ctx in contexts:
                ctx.kill()
        # Each stream counted its cleanup as it closed, so all of them are owed now.
        waiting = worker.pending_cleanups
        gc.collect()
        started = time.perf_counter()
    elapsed = time.perf_counter() - started
    return {
        "pending_cleanups": waiting,
        "grace_s": grace,
        "shutdown_ms": 1e3 * elapsed,
        "over_grace_ms": 1e3 * (elapsed - grace),
    }
