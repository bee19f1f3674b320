"""The SimEngine's ``poll-then-abort`` in the harness's scenarios: the model beside the real thing.

``poll-then-abort`` models Dynamo 1.6's SGLang worker for the SimEngine
sweep. Here it runs the very scenarios that Dynamo's own handler runs on the
real TokenizerManager (``_harness_sweep.py``), on a ``SimEngine`` with the
harness's timing, so the two can be set side by side. It runs on a
``MockClock``: what comes out is the model's own prediction, with no event
loop noise in it.

The caller is the baseline's consumer. It cancels with the baseline's
disconnect callback, or leaves without it; its stream ends when the
baseline's pump is done with the engine stream (what the real handler's
stream ending is: the worker's side of the request is gone).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

import trio_sglang as ts
from _approaches import PollThenAbort, StreamRecord
from trio_sglang_harness import (
    CallerStream,
    Observation,
    Scenario,
    observe_caller,
    sim_scheduler_events,
)

__all__ = ["observe_poll_then_abort"]


async def observe_poll_then_abort(
    scenario: Scenario, *, first_token_delay: float, token_interval: float
) -> Observation:
    """``scenario`` through ``poll-then-abort`` on a fresh SimEngine with the harness's timing."""
    engine = ts.SimEngine(
        tokenize_delay=scenario.tokenize_delay,
        dispatch_delay=0.0,
        first_token_delay=first_token_delay,
        token_interval=token_interval,
    )
    async with engine.running(), trio.open_nursery() as nursery:
        baseline = PollThenAbort(engine, nursery)
        events = partial(sim_scheduler_events, engine)
        seen = await observe_caller(partial(_stream, baseline), engine, scenario, events)
        nursery.cancel_scope.cancel()  # a retry still waiting, past the settle
    return seen


@asynccontextmanager
async def _stream(
    baseline: PollThenAbort, request: Mapping[str, Any]
) -> AsyncIterator[CallerStream]:
    rec = StreamRecord(offset=0.0)
    async with baseline.stream(request, rec) as chunks:

        async def rid() -> str:
            await trio.lowlevel.checkpoint()
            return rec.rid

        yield CallerStream(chunks, "native", rec.cancel, rid)
    await chunks.server_ended()
