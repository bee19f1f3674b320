"""Helpers shared by the test modules: the engine most lifecycle tests run on, stream readers
and an observer that records.

These are plain functions and classes, not fixtures: module-level helpers and constants use
them too. pytest imports this file as the module ``conftest``, with ``tests/``
on ``sys.path`` (the default "prepend" import mode, which also lets the tests
import ``_fuzz`` and ``_strategies``), so a test module imports them by name:
``from conftest import slow_sim``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

import pytest

import trio_sglang as ts
from trio_sglang.testing import Faults, FaultyEngine

#: The lifecycle tests' timeline: registered at 0, tokenizing until 1,
#: dispatched at 1.5, the first token at 2.5, then one every second.
SLOW_KNOBS: Mapping[str, float] = {
    "tokenize_delay": 1.0,
    "dispatch_delay": 0.5,
    "first_token_delay": 1.0,
    "token_interval": 1.0,
}


#: A request of five tokens, and one still decoding when every bound of a cleanup has run out.
HELLO: Mapping[str, Any] = {"text": "hello", "sampling_params": {"max_new_tokens": 5}}
LONG: Mapping[str, Any] = {"text": "hello", "sampling_params": {"max_new_tokens": 50}}


#: A prefill/decode pair's timing: 0.1 s a prompt token, in chunks of 4;
#: 0.5 s to bootstrap, and again to send the KV.
TIMING = ts.SimDisaggTiming(
    prefill_time_per_token=0.1,
    prefill_chunk_tokens=4,
    bootstrap_delay=0.5,
    kv_transfer_delay=0.5,
    kv_wait_timeout=300.0,
)


def slow_sim(**overrides: Any) -> ts.SimEngine:
    """A SimEngine on ``SLOW_KNOBS``: registered at 0, dispatched at 1.5, tokens at 2.5, 3.5, ..."""
    return ts.SimEngine(**{**SLOW_KNOBS, **overrides})


def finish_reason(chunk: Mapping[str, Any], output: str) -> str | None:
    """A chunk's finish reason in any output mode (of a native chunk, its ``type``)."""
    if output == "tokens":
        return chunk["finish_reason"]
    if output == "text":
        return chunk["choices"][0]["finish_reason"]
    reason = chunk["meta_info"]["finish_reason"]
    return None if reason is None else reason["type"]


async def read(
    worker: ts.Worker,
    request: Mapping[str, Any],
    ctx: ts.RequestContext,
    *,
    leave_after: int | None = None,
) -> int:
    """Read the stream to its end, or leave after ``leave_after`` chunks; how many were read."""
    chunks = 0
    async with worker.generate(request, ctx) as stream:
        async for _ in stream:
            chunks += 1
            if chunks == leave_after:
                break
    return chunks


def unchecked(request: object, output: object) -> NoReturn:
    """``Shared.check`` for a request a test builds by hand: never asked, as nothing opens it."""
    raise AssertionError("a request built by hand is never checked")


class Recorder:
    """A ``WorkerObserver`` that keeps each report, in order, as it heard it.

    The tests pin each cleanup's duration and which fault was reported, not
    only how many: more than the server's metrics keep.
    """

    def __init__(self) -> None:
        self.faults: list[ts.EngineFault] = []
        self.cleanups: list[tuple[float, bool]] = []

    def cleanup_finished(self, seconds: float, *, released: bool) -> None:
        self.cleanups.append((seconds, released))

    def engine_fault(self, kind: ts.EngineFault) -> None:
        self.faults.append(kind)


# -- the sglang session's exit -----------------------------------------------------------

_exit_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without Python's teardown when SGLang was imported in this process.

    SGLang 0.5.23 with its CPU torch build segfaults in the interpreter's
    teardown once the sglang session's tests have imported enough of it here
    (no Python frame: native destructors), after every result is reported.
    Nothing is left to do then but exit with the session's own status.
    """
    if "sglang" in sys.modules and _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])


def fault_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The worker's engine-fault lines, in the order it logged them."""
    return [r for r in caplog.records if r.getMessage().startswith("engine fault ")]


class RecordingEngine(FaultyEngine):
    """A ``FaultyEngine`` that keeps every ``/generate`` body the worker sends."""

    def __init__(self, inner: ts.Engine, faults: Faults | None = None) -> None:
        super().__init__(inner, faults or Faults())
        self.bodies: list[Mapping[str, Any]] = []

    def generate(self, request: Mapping[str, Any]) -> Any:
        self.bodies.append(request)
        return super().generate(request)


def sim_pair(
    rooms: ts.SimKVRooms, knobs: Mapping[str, Any] = SLOW_KNOBS, timing: ts.SimDisaggTiming = TIMING
) -> tuple[ts.SimEngine, ts.SimEngine]:
    """A prefill and a decode SimEngine sharing ``rooms``."""
    sides = {**knobs, "kv_rooms": rooms, "disagg_timing": timing}
    prefill = ts.SimEngine(**sides, disaggregation_mode="prefill")
    return prefill, ts.SimEngine(**sides, disaggregation_mode="decode")
