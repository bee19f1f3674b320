"""No per-request leftovers: after many cancelled requests the worker's own state is empty.

Judged two ways: the worker's collections (open streams, cleanup scopes,
pending count) are back to empty, and a tracemalloc snapshot diff over the
lifecycle's own modules (not the SimEngine, whose trace grows by design)
shows no growth proportional to the number of requests.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import trio
import trio.testing

import trio_sglang as ts

LIFECYCLE_FILES = (
    "_core/_worker.py",
    "_core/_lifecycle.py",
    "_core/_cleanup.py",
    "_core/_cleanup_group.py",
    "_core/_drain.py",
    "_core/_reports.py",
    "_core/_context.py",
    "_core/_outputs.py",
)
REQUESTS = 10_000
BATCH = 500


async def cancel_many(worker: ts.Worker, count: int) -> None:
    async def one(i: int) -> None:
        ctx = ts.RequestContext(f"req-{i}")
        request = {"text": "hello", "sampling_params": {"max_new_tokens": 8}}
        async with worker.generate(request, ctx, output="tokens") as chunks:
            async for _ in chunks:
                ctx.kill()  # mid-stream, after the first token

    for start in range(0, count, BATCH):
        async with trio.open_nursery() as nursery:
            for i in range(start, min(start + BATCH, count)):
                nursery.start_soon(one, i)
        await trio.testing.wait_all_tasks_blocked()


def lifecycle_memory(snapshot: tracemalloc.Snapshot) -> tuple[int, int]:
    """Bytes and blocks allocated by the lifecycle's modules and still alive."""
    package = Path(ts.__file__).parent
    missing = [name for name in LIFECYCLE_FILES if not (package / name).is_file()]
    assert not missing, f"moved? the filter would match nothing: {missing}"
    filters = [tracemalloc.Filter(True, f"*trio_sglang/{name}") for name in LIFECYCLE_FILES]
    stats = snapshot.filter_traces(filters).statistics("filename")
    return sum(stat.size for stat in stats), sum(stat.count for stat in stats)


async def test_ten_thousand_cancels_leave_nothing_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ts.SimEngine(
        tokenize_delay=0.01, dispatch_delay=0.001, first_token_delay=0.01, token_interval=0.01
    )
    async with ts.open_worker(engine) as worker:
        await cancel_many(worker, BATCH)  # warm up caches and interned strings
        gc.collect()
        tracemalloc.start()
        try:
            before, blocks_before = lifecycle_memory(tracemalloc.take_snapshot())
            await cancel_many(worker, REQUESTS)
            gc.collect()
            after, blocks_after = lifecycle_memory(tracemalloc.take_snapshot())
        finally:
            tracemalloc.stop()
        assert worker.open_streams == 0
        assert worker.pending_cleanups == 0
        assert worker._cleanups.pending == 0  # no engine-side task of the worker is left
        assert engine.live_rids() == set()
    print(
        f"lifecycle memory after {REQUESTS} cancels: {after - before:+d} bytes, "
        f"{blocks_after - blocks_before:+d} blocks"
    )
    # Nothing per request survives: a handful of blocks at most, for 10,000
    # requests. The bytes allow one high-water mark (an emptied set keeps its
    # largest table, up to 32 KiB), since which burst of the run first needs
    # it depends on trio's randomised scheduling.
    assert blocks_after - blocks_before < 10
    assert after - before <= 64 * 1024
    aborted = sum(1 for e in engine.trace if e.kind == "abort_applied")
    assert aborted == REQUESTS + BATCH
