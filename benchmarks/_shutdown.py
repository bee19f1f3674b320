"""How long leaving the worker takes with many detached aborts still pending.

The SPEC bounds it by the policy's ``shutdown_grace`` plus twice what bare
trio takes to cancel as many parked tasks as the worker holds, measured in
the same run. To have cleanup that is really pending, the engine has no
release path on close (``release_on_close=False``) and tokenizes for longer
than the run: every killed stream leaves cleanup waiting (woken, bounded) for
the dispatch it needs before it may abort, and the worker's exit has to
cancel all of it after the grace.

What the clock starts on is what a real server has when it is told to stop:

- no collection between the setup and the clock. A server does not get one,
  so the debt the collector carries from setting up the 1,000 streams is the
  shutdown's to pay (unlike the cells, ``_meter.py``, which time cancels
  served in a steady state, not the exit of a loaded process);
- the worker's tasks are parked: the clock starts once every task of the run
  is blocked, so that it does not also time the first steps of cleanup the
  kills have only just handed over (that is the kills' cost, not the exit's).

The floor (``_trio_floor.bare_trio_shutdown``: one scope cancelled over
that many parked tasks in one nursery, the shutdown's own shape) counts the
tasks, not the requests: on this engine each pending request holds two (the
reader that keeps the engine's stream going until the dispatch, and the
ordered abort that waits for it). ``Worker`` has no public count of its tasks
(``pending_cleanups`` counts requests), so the count is trio's own, public
one: the tasks alive in the run when the clock starts, less those alive with
the same worker open and idle. That is every task the exit has to end, the
engine's included (the SimEngine adds none per request here).

Beside the floor, and judged by nothing, the same floor at the worker's own
shape (``WORKER_SHAPE``): trio's cost of unwinding tasks as deep as the
worker's, each inside the cancel scopes its waits are bounded by, so that the
reader can tell that from the worker's own work.

The floor runs right after the exit, in the same process and run, in the
same heap (the setup's streams stay alive until it is done), with the
collector on. Each of the two starts the same way: a collection before its
own setup, none between its setup and its clock. So each pays the
collector's debt of its own setup, and neither the other's: without the
collection before the floor's setup, the full collection the shutdown's
setup is owed (tens of milliseconds here) lands in whichever of the two
tips it first, and the verdict follows where it fell: met when the floor
paid it (its double then allowed that much more), missed by far when the
shutdown did. Without the one before the shutdown's setup, the debt of the
benchmark's steps before it (10,000 streams cancelled at once) would be the
shutdown's. Neither measurement then depends on whether the other ran
before or after it. ``gc_ms`` and ``trio_floor_gc_ms`` say how much of each
went to the collector.
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
