"""The cancel-latency benchmark's core, on a tiny config: it runs, its output has the
documented shape, and it tells the approaches apart the way SGLang's semantics say it must.
A run writes its own results folder and prints the paths; its tables fit in 100 columns;
time targets are judged only on a quiet machine.

No wall-clock thresholds: only counts and structure. The one timing the asserts lean on
is the slow-tokenization phase's own margin (a 1 s tokenization against poll-then-abort's
0.25 s dispatch wait, cancels at most 0.5 s in), which is hundreds of milliseconds wide.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import trio
import trio.testing

from _benchmarks import benchmark_fixture

GRID = (("before_first_token", 1), ("slow_tokenization", 10))
APPROACHES = ("trio-sglang", "first-response", "poll-then-abort")


bench = benchmark_fixture("cancel_latency")


@pytest.fixture(scope="module")
def report(bench: ModuleType) -> Any:
    """One tiny run (a few seconds, real time), shared by the tests below."""
    config = bench.Config(
        grid=GRID,
        min_cancels=1,
        settle_timeout=0.5,
        at_once=20,
        at_once_approaches=("trio-sglang",),
        at_once_gc_frozen=False,
        memory_streams=20,
        throughput_rounds=1,
        throughput_streams=4,
        throughput_tokens=50,
        shutdown_pending=20,
    )
    return trio.run(bench.run_benchmark, config)


def by_cell(data: dict[str, Any]) -> dict[tuple[str, str, int], dict[str, Any]]:
    return {(r["approach"], r["phase"], r["concurrency"]): r for r in data["results"]}


def test_tiny_run_has_the_documented_shape(report: Any) -> None:
    data = json.loads(json.dumps(report.to_json({"python": "test"})))
    cells = by_cell(data)
    assert set(cells) == {(a, p, c) for a in APPROACHES for p, c in GRID}
    for cell in data["results"] + data["at_once"]:
        assert cell["cancels"] == cell["concurrency"]
        for key in ("stream_close_ms", "abort_delay_ms", "wasted_tokens"):
            assert set(cell[key]) == {"p50", "p99", "max"}
        assert cell["stream_close_ms"]["max"] is not None  # every caller's stream closed
        assert 0 <= cell["off_phase"] <= cell["cancels"]
    assert data["throughput_ratio"] > 0
    assert data["memory"]["bytes_per_request"] > 0
    assert data["shutdown"]["pending_cleanups"] == 20
    assert [cell["approach"] for cell in data["at_once"]] == ["trio-sglang"]
    assert data["at_once"][0]["trio_floor_ms"] > 0  # the floors ran beside the burst
    assert data["at_once"][0]["engine_floor_ms"] > 0
    assert len(data["targets"]) == 9
    keys = {"what", "target", "measured", "met", "verdict", "judged"}
    assert all(set(t) == keys for t in data["targets"])
    assert set(data["machine_state"]) >= {"quiet", "load", "cores", "worst_stall_ms"}
    ratios = {(row["phase"], row["concurrency"]): row for row in data["ratios"]}
    assert set(ratios) == {(p, c) for p, c in GRID}  # the at-once burst ran trio-sglang only
    slow = ratios["slow_tokenization", 10]["abort_delay_ms"]
    assert slow["p99"]["poll-then-abort"] is None  # never stopped: no finite ratio
    assert slow["ratio"]["poll-then-abort"] is None
    assert slow["ratio"]["first-response"] > 1  # it waits for the first output


def test_trio_sglang_loses_and_leaks_nothing(report: Any) -> None:
    ours = [c for c in report.results + report.at_once if c.approach == "trio-sglang"]
    assert ours
    for cell in ours:
        assert (cell.aborts_lost, cell.leaked, cell.unstopped) == (0, 0, 0), cell.phase
        assert max(cell.wasted_tokens) == 0


def test_baselines_show_their_gaps(report: Any) -> None:
    cells = by_cell(report.to_json({}))
    polled = cells["poll-then-abort", "slow_tokenization", 10]
    # The abort went out before dispatch: the scheduler lost it, abort_sent
    # dropped every retry, and the request ran on.
    assert polled["aborts_lost"] > 0
    assert polled["leaked"] > 0
    assert polled["abort_delay_ms"]["max"] is None  # never stopped
    first = cells["first-response", "slow_tokenization", 10]
    # Never an abort before the first output: nothing lost, but the first token is wasted.
    assert (first["aborts_lost"], first["leaked"]) == (0, 0)
    assert first["wasted_tokens"]["max"] >= 1


def test_report_renders(bench: ModuleType, report: Any) -> None:

    text = report.format()
    for name in APPROACHES:
        assert name in text
    assert "SPEC" not in text
    # First the ratios against the baselines of this run, then the targets, then the cells.
    ratios = text.index("abort delay p99")
    targets = text.index("targets (")
    cells = text.index("close p50/p99")
    assert ratios < targets < cells
    assert re.search(r"^slow_tokenization +[0-9.]+ ms .* never ", text, re.MULTILINE)


def test_tables_fit_in_100_columns(
    report: Any, disagg: ModuleType, disagg_report: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import _phases

    longest = max(_phases.PHASES, key=len)
    for cell in report.results:  # the widest names and counts a default run has
        monkeypatch.setattr(cell, "phase", longest if cell.concurrency == 1 else cell.phase)
        monkeypatch.setattr(cell, "concurrency", 10_000 * cell.concurrency)
    for text in (report.format(), disagg_report.format()):
        widths = [len(line) for line in text.splitlines()]
        assert max(widths) <= 100, max(widths)


# -- the busy-machine rule: a pure function of the load figures and the stalls -------


def measured_on(
    report: Any,
    monkeypatch: pytest.MonkeyPatch,
    load: tuple[float, float],
    own: float,
    stall: float,
) -> None:
    """Make the tiny run look as if it ran on a 2-core machine with these figures."""
    monkeypatch.setattr(report, "load_average", load)
    monkeypatch.setattr(report, "cpu_s", own * report.runtime_s)
    monkeypatch.setattr(report, "cores", 2)
    for cell in report.cells:
        monkeypatch.setattr(cell, "stall_max_ms", stall)


def test_quiet_machine_judges_every_target(report: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import _report
    import _verdict

    quiet = _verdict.judge_machine(0.3, 1.1, 2, own_load=0.8, worst_stall_ms=1.0)
    assert quiet.quiet  # others' load: max(0.3, 1.1 - 0.8) = 0.3 <= 0.5 x 2
    judged = _report.targets(report, quiet)
    assert all(not target.not_judged for target in judged)
    assert {target.verdict for target in judged} <= {"met", "MISSED", "not run"}
    measured_on(report, monkeypatch, (0.3, 1.1), own=0.8, stall=1.0)
    text = report.format()
    assert "machine quiet (load 0.30 on 2 cores)" in text
    assert "not judged" not in text


@pytest.mark.parametrize(
    ("before", "after", "own", "stall", "shown"),
    [
        (1.6, 1.8, 0.5, 0.0, "load 1.60 on 2 cores"),  # busy before the run
        (0.2, 2.4, 0.9, 0.0, "load 1.50 on 2 cores"),  # others' load grew during it
        (0.2, 0.4, 0.2, 12.0, "load 0.20 on 2 cores; OS stall 12.0 ms"),  # the OS stalled us
    ],
)
def test_busy_machine_judges_only_counts(
    report: Any,
    monkeypatch: pytest.MonkeyPatch,
    before: float,
    after: float,
    own: float,
    stall: float,
    shown: str,
) -> None:
    import _report
    import _verdict

    busy = _verdict.judge_machine(before, after, 2, own_load=own, worst_stall_ms=stall)
    assert not busy.quiet
    judged = _report.targets(report, busy)
    raw = _report.targets(report)
    for target, unjudged in zip(judged, raw, strict=True):
        if target.kind == "count":
            assert target == unjudged  # counts are judged on any machine
        elif unjudged.met is not None:
            assert target.met is None
            assert target.verdict == f"not judged: machine busy ({shown})"
    assert sum(target.kind == "time" for target in judged) == 6
    # The rendered report follows the machine the run measured.
    measured_on(report, monkeypatch, (before, after), own, stall)
    text = report.format()
    assert "[not judged]" in text
    assert f"not judged: machine busy ({shown})" in text
    for line in text.splitlines():
        if any(what in line for what in ("stream close p99", "tokens/s", "shutdown with")):
            assert "met" not in line
            assert "MISSED" not in line


# -- the at-once burst and its two floors ----------------------------------------------


def test_the_engine_alone_floor_releases_every_request_through_the_engine(
    bench: ModuleType,
) -> None:
    import _cells

    cell = trio.run(_cells.run_at_once, "engine-alone", 30)
    # Each cancelled pull ran the engine's own release path: every stream closed,
    # every request was stopped at the engine, no abort was lost, nothing was left.
    assert len(cell.stream_close_ms) == len(cell.abort_delay_ms) == 30
    assert (cell.aborts_lost, cell.leaked, cell.unstopped) == (0, 0, 0)
    assert cell.all_stopped_ms is not None


def test_the_engine_alone_floor_refuses_an_engine_that_does_not_release_on_close(
    bench: ModuleType,
) -> None:
    import _approaches
    import trio_sglang as ts

    with pytest.raises(ValueError, match="releases on close"):
        _approaches.EngineAlone(ts.SimEngine(release_on_close=False))


def test_the_burst_line_shows_both_floors(bench: ModuleType, report: Any) -> None:
    import _report

    (cell,) = [c for c in report.at_once if c.approach == "trio-sglang"]
    cell = _copy_cell(cell, stream_close_ms=[300.0], abort_delay_ms=[600.0])
    cell.extra.update(trio_floor_ms=300.0, engine_floor_ms=400.0)
    target = _report._at_once([cell])
    assert target.measured == (
        f"{cell.concurrency:,} stopped in 600 ms; bare trio 300 ms (2.0x); "
        "the engine alone 400 ms (1.5x)"
    )
    del cell.extra["engine_floor_ms"]  # runs recorded before it had no engine floor
    assert _report._at_once([cell]).measured.endswith("bare trio 300 ms (2.0x)")


def _copy_cell(cell: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(cell, extra=dict(cell.extra), **changes)


# -- the shutdown target: the grace plus twice bare trio, measured in the same run ----


def test_shutdown_measures_its_floor_with_as_many_tasks(report: Any) -> None:
    shutdown = json.loads(json.dumps(report.to_json({"python": "test"})))["shutdown"]
    assert shutdown["pending_cleanups"] == 20
    # Each pending request holds at least one task (two on an engine without release on close).
    assert shutdown["pending_tasks"] >= shutdown["pending_cleanups"]
    assert shutdown["shutdown_ms"] >= 1e3 * shutdown["grace_s"]
    assert shutdown["over_grace_ms"] == pytest.approx(
        shutdown["shutdown_ms"] - 1e3 * shutdown["grace_s"]
    )
    assert 0 <= shutdown["gc_ms"] <= shutdown["shutdown_ms"]
    assert shutdown["trio_floor_ms"] > 0  # the floor ran beside the shutdown
    assert 0 <= shutdown["trio_floor_gc_ms"] <= shutdown["trio_floor_ms"]


def test_shutdown_floor_cancels_every_parked_task(bench: ModuleType) -> None:
    import _shutdown
    import _trio_floor

    async def main() -> tuple[int, float, float]:
        idle = _shutdown.live_tasks()
        async with trio.open_nursery() as nursery:
            for _ in range(30):
                nursery.start_soon(trio.sleep_forever)
            await trio.testing.wait_all_tasks_blocked()
            parked = _shutdown.live_tasks() - idle
            nursery.cancel_scope.cancel()
        empty, _ = await _trio_floor.bare_trio_shutdown(0)
        floor, floor_gc = await _trio_floor.bare_trio_shutdown(50)
        assert 0 <= floor_gc <= floor
        assert _shutdown.live_tasks() == idle  # the floor left no task behind
        return parked, empty, floor

    parked, empty, floor = trio.run(main)
    assert parked == 30
    assert empty >= 0
    assert floor > 0


def test_shutdown_times_the_collector_only_inside_its_block(bench: ModuleType) -> None:
    import gc

    import _trio_floor

    with _trio_floor.collector_ms() as spent:
        gc.collect()
    gc.collect()
    assert len(spent) == 1
    assert spent[0] >= 0


SHUTDOWN = {
    "pending_cleanups": 1000,
    "pending_tasks": 2000,
    "grace_s": 0.25,
    "shutdown_ms": 330.0,
    "over_grace_ms": 80.0,
    "gc_ms": 3.0,
    "trio_floor_ms": 40.0,
    "trio_floor_gc_ms": 1.0,
}


@pytest.mark.parametrize(
    ("changes", "met"),
    [
        ({}, True),  # 80 ms over the grace against 2 x 40 ms: met, just
        ({"over_grace_ms": 80.5, "shutdown_ms": 330.5}, False),
        ({"trio_floor_ms": 39.0}, False),
        ({"pending_cleanups": 999}, False),  # the target is for 1,000 pending aborts
    ],
)
def test_shutdown_target_is_the_grace_plus_twice_bare_trio(
    bench: ModuleType, changes: dict[str, Any], met: bool
) -> None:
    import _report

    target = _report._shutdown({**SHUTDOWN, **changes})
    assert target.kind == "time"
    assert target.target == "<= grace + 2x bare trio"
    assert target.met is met
    assert _report._shutdown(None).measured == "not run"


def test_shutdown_figures_in_the_report(
    bench: ModuleType, report: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import _report
    import _verdict

    monkeypatch.setattr(report, "shutdown", dict(SHUTDOWN))
    (target,) = [t for t in _report.targets(report) if t.what.startswith("shutdown")]
    assert target.measured == (
        "grace 250 ms + 80 ms; bare trio 40.00 ms (2.0x; 1,000 pending, 2,000 tasks)"
    )
    text = report.format()
    assert "(target <= grace + 2x bare trio)" in text
    summary = " ".join(text.split())  # the summary line, unwrapped
    assert (
        "shutdown: 330 ms with 1,000 pending cleanups (grace 250 ms, 80 ms over it, 3 ms of the "
        "whole in garbage collection); bare trio cancelling 2,000 parked tasks right after: "
        "40.00 ms (1 ms of it in garbage collection)"
    ) in summary
    busy = _verdict.judge_machine(2.0, 2.0, 2, own_load=0.0, worst_stall_ms=0.0)
    (unjudged,) = [t for t in _report.targets(report, busy) if t.what.startswith("shutdown")]
    assert unjudged.met is None  # a time target: judged only on a quiet machine
    assert unjudged.verdict.startswith("not judged: machine busy")
    # The widest figures a full run could give still fit the terminal's 100 columns.
    widest = {"over_grace_ms": 12345.0, "trio_floor_ms": 1234.0, "pending_tasks": 20_000}
    monkeypatch.setattr(report, "shutdown", {**SHUTDOWN, **widest, "pending_cleanups": 10_000})
    assert max(len(line) for line in report.format().splitlines()) <= 100


# -- every run writes its own folder and prints the paths ---------------------------


STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ")


def test_a_run_writes_its_folder_and_prints_the_paths(
    bench: ModuleType,
    report: Any,
    disagg: ModuleType,
    disagg_report: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``main`` as the command line runs it, on the tiny run's results (not run again)."""

    async def measured(config: Any, progress: Any) -> Any:
        return report

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "run_benchmark", measured)
    assert bench.main(["--quick"]) == 0
    out, err = capsys.readouterr()
    (folder,) = (tmp_path / "bench-results").iterdir()
    assert STAMP.fullmatch(folder.name)
    files = ["results.json", "summary.md"]
    try:
        import matplotlib  # noqa: F401

        files.append("latency.png")
    except ImportError:
        assert "no latency.png: the PNG needs matplotlib" in out
    assert sorted(path.name for path in folder.iterdir()) == sorted(files)
    printed = out[out.index("files:") :]
    for name in files:
        assert str(Path("bench-results", folder.name, name)) in printed
    assert "done:" in err  # the progress bar went to stderr
    data = json.loads((folder / "results.json").read_text())
    assert len(data["targets"]) == 9
    summary = (folder / "summary.md").read_text()
    assert summary.startswith(f"# Cancel latency, {folder.name}")
    assert "## Against the baselines" in summary
    assert "## Targets" in summary

    # The prefill/decode benchmark shares the folder (as `nox -s bench` has it do).
    monkeypatch.setattr(disagg, "run_benchmark", lambda config, progress: disagg_report)
    assert disagg.main(["--quick", "--out", str(folder)]) == 0
    out = capsys.readouterr().out
    assert str(folder / "disagg.json") in out
    assert json.loads((folder / "disagg.json").read_text())["results"]
    summary = (folder / "summary.md").read_text()
    assert summary.startswith("# Cancel latency")
    assert "## Prefill/decode pair" in summary
    # Another run, another folder.
    assert bench.main(["--quick"]) == 0
    assert len(list((tmp_path / "bench-results").iterdir())) == 2


def test_command_line(bench: ModuleType) -> None:
    parser = bench.build_parser()
    quick = bench.config_from_args(parser.parse_args(["--quick"]))
    assert {size for _, size in quick.grid} == {1, 100}
    assert len(quick.grid) == 10
    assert quick.at_once_approaches == ("trio-sglang",)
    default = bench.config_from_args(parser.parse_args([]))
    assert {size for _, size in default.grid} == {1, 100, 1000}
    assert default.at_once_approaches == APPROACHES  # the burst against the baselines too
    full = bench.config_from_args(parser.parse_args(["--full"]))
    assert {size for _, size in full.grid} == {1, 100, 1000, 10_000}
    assert full.at_once_gc_frozen
    assert default.steps() < full.steps()
    with pytest.raises(SystemExit):
        parser.parse_args(["--quick", "--full"])
    chosen = bench.config_from_args(
        parser.parse_args(["--phases", "mid_stream", "--concurrency", "1,1000", "--at-once", "0"])
    )
    assert chosen.grid == (("mid_stream", 1), ("mid_stream", 1000))
    assert chosen.at_once_runs() == []
    with pytest.raises(SystemExit):
        parser.parse_args(["--phases", "no_such_phase"])


def test_plot(bench: ModuleType, report: Any, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import _plot

    path = tmp_path / "latency.png"
    _plot.plot(report.results + report.at_once, path)
    assert path.read_bytes().startswith(b"\x89PNG")
    fig = _plot.figure(report.results + report.at_once)
    burst = [ax for ax in fig.axes if ax.get_title().startswith("at_once")]
    assert len(burst) == 2
    labels = {ax.get_ylabel() for ax in burst}
    assert len(labels) == 2  # each at-once panel names its own measure
    assert all(ax.get_yscale() == "linear" and len(ax.get_yticks()) >= 3 for ax in burst)


# -- disagg_cancel.py: cancels on a prefill/decode pair, on MockClock ----------------
#
# Sim seconds, so every number below is exact for the seed; the asserts still only
# compare approaches and count leaks, so that a change of the workload's knobs does
# not break them while a lifecycle that wastes prefill work or holds decode
# requests does.

DISAGG_APPROACHES = ("trio-sglang", "first-response", "prefill-abort")


disagg = benchmark_fixture("disagg_cancel")


@pytest.fixture(scope="module")
def disagg_report(disagg: ModuleType) -> Any:
    """The ``--quick`` run (300 requests on each approach; a few seconds)."""
    return disagg.run_benchmark(disagg.Config(disagg.QUICK))


def disagg_results(report: Any) -> dict[str, Any]:
    return {result.approach: result for result in report.results}


def test_disagg_run_has_the_documented_shape(disagg_report: Any) -> None:
    data = json.loads(json.dumps(disagg_report.to_json({"python": "test"})))
    assert "MockClock" in data["clock"]
    assert [r["approach"] for r in data["results"]] == list(DISAGG_APPROACHES)
    for result in data["results"]:
        assert result["requests"] == 300
        assert result["stayed"] + result["cancels"] + result["ended_before_their_cancel"] == 300
        assert set(result["phases"]) == set(data["phases"])
        assert sum(p["cancels"] for p in result["phases"].values()) == result["cancels"]
        for key in ("ttft_s", "decode_hold_s"):
            assert {"p50", "p99", "max"} <= set(result[key])
        assert result["bound_hits"] == 0  # no baseline bound decided anything
    ours = disagg_results(disagg_report)["trio-sglang"]
    assert all(phase.cancels for phase in ours.phases.values())  # every phase was hit


def test_disagg_trio_sglang_wastes_at_most_a_chunk_and_leaks_nothing(disagg_report: Any) -> None:
    results = disagg_results(disagg_report)
    ours, old = results["trio-sglang"], results["first-response"]
    timing = disagg_report.config.workload.timing.disagg
    chunk_s = timing.prefill_chunk_tokens * timing.prefill_time_per_token
    assert ours.cancels > 50
    assert max(ours.wasted_prefill_s) <= chunk_s + 1e-9  # the forward in flight, no more
    assert sum(ours.wasted_prefill_s) * 5 < sum(old.wasted_prefill_s)
    assert sum(ours.hol_delay_s) * 5 < sum(old.hol_delay_s)
    assert (ours.decode_held, ours.kv_timeouts, ours.decode_tokens_after_cancel) == (0, 0, 0)
    assert (ours.live_at_end, ours.aborts_lost, ours.stayed_failed) == (0, 0, 0)


def test_disagg_baselines_show_their_gaps(disagg_report: Any) -> None:
    results = disagg_results(disagg_report)
    old, half = results["first-response"], results["prefill-abort"]
    kv_wait = disagg_report.config.workload.timing.disagg.kv_wait_timeout
    # #13691: the prefill of a client that left runs on; #14368: its decode request is
    # held until the first output, and aborted only then (one token wasted each).
    assert old.phases["waiting"].cancels
    assert min(old.phases["waiting"].wasted_prefill_s) > 0
    assert old.decode_held > 0
    assert old.decode_tokens_after_cancel > 0
    # Cancelling the prefill alone does not tell the decode side: it waits out its timeout.
    assert half.kv_timeouts > 0
    assert max(half.decode_hold_s) > kv_wait / 2
    # Both are faithful models, not leaky ones: nothing lost, nothing left at the end.
    for result in (old, half):
        assert (result.live_at_end, result.aborts_lost) == (0, 0)


def test_disagg_report_renders(disagg: ModuleType, disagg_report: Any) -> None:
    text = disagg_report.format()
    for name in DISAGG_APPROACHES:
        assert name in text
    assert "MockClock" in text
    assert "Per phase at the cancel" in text


def test_disagg_command_line(disagg: ModuleType) -> None:
    parser = disagg.build_parser()
    assert disagg.config_from_args(parser.parse_args(["--quick"])).workload == disagg.QUICK
    # `nox -s bench -- --full` passes --full to both: here it is the default size.
    assert disagg.config_from_args(parser.parse_args(["--full"])).workload == disagg.FULL
    assert disagg.config_from_args(parser.parse_args([])).workload == disagg.FULL
    with pytest.raises(SystemExit):
        parser.parse_args(["--quick", "--full"])
    chosen = disagg.config_from_args(
        parser.parse_args(["--requests", "10", "--load", "0.5", "--seed", "3"])
    ).workload
    assert (chosen.requests, chosen.load, chosen.seed) == (10, 0.5, 3)
    assert chosen.timing == disagg.FULL.timing
    with pytest.raises(SystemExit):
        parser.parse_args(["--load", "5"])
