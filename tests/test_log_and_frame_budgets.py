"""The budgets that keep one client from costing the server without bound.

``LogThrottle`` (a fault a client causes at will is a few log lines, not one
per request), the fault log's ``describe`` (no line carries a request whole),
and HTTP/2's ``ControlBudget`` (frames that ask for nothing). All on trio's
``MockClock``.
"""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from trio_sglang._core._reports import EngineFault, Reports, describe
from trio_sglang._core._throttle import LogThrottle
from trio_sglang.server._h2 import ControlBudget


async def test_the_throttle_lets_a_few_lines_of_a_kind_through_in_each_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    throttle = LogThrottle(lines=3, interval=10.0)
    taken = [throttle.take("a") for _ in range(5)]
    assert taken == [0, 0, 0, None, None]
    assert throttle.take("b") == 0  # each kind has its own lines
    await trio.sleep(9.9)
    assert throttle.take("a") is None
    await trio.sleep(0.1)
    assert throttle.take("a") == 3  # the next line says how many were left out
    assert [throttle.take("a") for _ in range(3)] == [0, 0, None]


async def test_faults_of_one_kind_are_logged_ten_in_ten_seconds_and_all_counted(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    counted: list[str] = []

    class Observer:
        def cleanup_finished(self, seconds: float, *, released: bool) -> None:
            pass

        def engine_fault(self, kind: EngineFault) -> None:
            counted.append(kind)

    reports = Reports(Observer())
    caplog.set_level(logging.ERROR, logger="trio_sglang")
    for i in range(25):
        reports.fault("stream_error", f"pub-{i}", [f"rid-{i}"], "boom")
    reports.fault("close_error", "other", [], "boom")
    await trio.sleep(10)
    reports.fault("stream_error", "late", [], "boom")
    lines = [record.getMessage() for record in caplog.records]
    assert len(counted) == 27
    assert len(lines) == 12
    assert lines[-1].endswith("boom (15 more of this kind not logged before it)")


def test_a_faults_line_carries_a_bounded_message_and_no_repr(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompt = "secret prompt " * 10_000
    error = UnicodeEncodeError("utf-8", '{"text": "' + prompt + '"}', 5, 6, "surrogates")
    assert prompt not in describe(error)
    assert describe(error).startswith("UnicodeEncodeError: 'utf-8' codec can't encode")

    async def main() -> None:
        Reports().fault("stream_error", "pub", [], prompt)

    caplog.set_level(logging.ERROR, logger="trio_sglang")
    trio.run(main)
    (line,) = [record.getMessage() for record in caplog.records]
    assert len(line) < 500
    assert line.endswith(f"... ({len(prompt)} characters)")


async def test_the_control_frame_budget_is_a_burst_then_a_rate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ControlBudget(burst=100, per_second=10.0)
    assert all(budget.take() for _ in range(100))
    assert not budget.take()
    await trio.sleep(1.0)
    assert sum(budget.take() for _ in range(50)) == 10
    await trio.sleep(1000)
    assert sum(budget.take() for _ in range(500)) == 100  # never more than the burst
