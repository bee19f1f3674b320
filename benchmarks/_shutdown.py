"""How long leaving the worker takes with many detached aborts still pending.

The target and the method are docs/benchmarks.md's ("The misses", shutdown).
The engine has no release path on close and tokenizes for longer than the
run, so every killed stream leaves cleanup really pending. The clock starts
once every task is parked, with no collection between the setup and the
clock (a server told to stop gets none). The floor (``_trio_floor``) runs
right after, in the same heap; each of the two is preceded by a collection
of its own, so that each pays the collector's debt of its own setup and
neither the other's: else the verdict follows wherever that one full
collection happens to land.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import trio
import trio.testing

import trio_sglang as ts
from _cells import wait_events
from _trio_floor import bare_trio_shutdown, collector_ms

__all__ = ["WORKER_SHAPE", "live_tasks", "shutdown_time"]

#: A pending task of the worker on this engine, as (frames above its park, cancel scopes
#: among them): the reader (its task, the reading, the engine stream, its tokenizing
#: sleep: the reader's pull scope and the sleep's), the ordered abort (its task, its
#: cleanup deadline, the abort, the engine's wait for the dispatch: that deadline and
#: the dispatch wait's).
WORKER_SHAPE = (6, 2)

REQUEST: dict[str, Any] = {
    "text": "shut down while I wait",
    "sampling_params": {"max_new_tokens": 8},
}


def live_tasks() -> int:
    """Tasks alive in the current trio run, counted through trio's public introspection."""
    root = trio.lowlevel.current_root_task()
    assert root is not None, "called outside a trio run"
    count, stack = 0, [root]
    while stack:
        task = stack.pop()
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count


async def shutdown_time(pending: int, grace: float = 0.25) -> dict[str, Any]:
    """Leave a worker with ``pending`` requests' cleanup waiting; time the exit and its floor."""
    gc.collect()  # before the setup: the debt of the steps before this one is not the exit's
    engine = ts.SimEngine(tokenize_delay=3600.0, release_on_close=False)
    contexts = [ts.RequestContext(f"shutdown-{index}") for index in range(pending)]

    async def consume(worker: ts.Worker, ctx: ts.RequestContext) -> None:
        async with worker.generate(REQUEST, ctx, output="tokens") as chunks:
            async for _ in chunks:
                pass

    with collector_ms() as collections:
        async with ts.open_worker(engine, policy=ts.AbortPolicy(shutdown_grace=grace)) as worker:
            await trio.testing.wait_all_tasks_blocked()
            idle = live_tasks()
            async with trio.open_nursery() as nursery:
                for ctx in contexts:
                    nursery.start_soon(consume, worker, ctx)
                await wait_events(engine, "registered", pending)
                for ctx in contexts:
                    ctx.kill()
            # Each stream counted its cleanup as it closed, so all of them are owed now.
            await trio.testing.wait_all_tasks_blocked()
            waiting = worker.pending_cleanups
            held = live_tasks() - idle
            collections.clear()  # the setup's; from here on, the shutdown's
            started = time.perf_counter()
        elapsed = time.perf_counter() - started
    # Before the floor's own setup, as before the shutdown's; the setup's streams
    # (``contexts``, ``engine``) stay alive: the heap the shutdown had.
    gc.collect()
    floor, floor_gc = await bare_trio_shutdown(held)
    gc.collect()
    depth, scopes = WORKER_SHAPE
    shaped, _ = await bare_trio_shutdown(held, depth=depth, scopes=scopes)
    return {
        "pending_cleanups": waiting,
        "pending_tasks": held,
        "grace_s": grace,
        "shutdown_ms": 1e3 * elapsed,
        "over_grace_ms": 1e3 * (elapsed - grace),
        "gc_ms": sum(collections),
        "trio_floor_ms": floor,
        "trio_floor_gc_ms": floor_gc,
        "trio_shaped_floor_ms": shaped,
        "worker_shape": {"frames": depth, "cancel_scopes": scopes},
    }
