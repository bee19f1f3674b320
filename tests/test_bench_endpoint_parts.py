"""``trio-sglang bench-endpoint``'s parts on made-up input: the metrics page reader, the server
kinds, the attribution of releases to the clients that left, the phases and the percentiles."""

from __future__ import annotations

import pytest

from trio_sglang.bench_endpoint._deconvolve import attribute_releases
from trio_sglang.bench_endpoint._departures import ALL_PHASES, parse_phases
from trio_sglang.bench_endpoint._prometheus import Series, metric_names, parse_series
from trio_sglang.bench_endpoint._report import (
    percentile,
)
from trio_sglang.bench_endpoint._sampler import Sample
from trio_sglang.bench_endpoint._servers import KINDS, custom_kind, detect_kind

# -- the metrics page -----------------------------------------------------------------------

PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="0"} 3.0
sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="1"} 2.0
sglang:num_queue_reqs{model_name="m"} 4.0
sglang:num_queue_reqs{model_name="m",priority="1"} 3.0
sglang:num_queue_reqs{model_name="m",priority="2"} 1.0
sglang:num_running_reqs_offline_batch{model_name="m"} 9.0
sglang:generation_tokens_total{model_name="a \\"quoted\\" {name}"} 1.5e+03
sglang:cache_hit_rate{model_name="m"} NaN
"""


def test_the_page_reader_sums_the_wanted_series_and_leaves_breakdowns_out() -> None:
    running = Series("sglang:num_running_reqs")
    queued = Series("sglang:num_queue_reqs", breakdowns=("priority",))
    tokens = Series("sglang:generation_tokens_total")
    absent = Series("vllm:num_requests_running")
    sums = parse_series(PAGE, [running, queued, tokens, absent])
    # Both data-parallel ranks; the queue's total only, not its per-priority shares;
    # a longer name that starts the same is another metric.
    assert sums == {running: 5.0, queued: 4.0, tokens: 1500.0, absent: None}
    assert parse_series(PAGE, [Series("sglang:cache_hit_rate")]) == {
        Series("sglang:cache_hit_rate"): 0.0
    }
    assert "sglang:num_running_reqs_offline_batch" in metric_names(PAGE)


def test_a_selector_parses_matches_and_prints_as_promql_writes_it() -> None:
    series = Series.parse('trio_sglang_sim_events_total{kind="token"}')
    assert series == Series("trio_sglang_sim_events_total", (("kind", "token"),))
    assert str(series) == 'trio_sglang_sim_events_total{kind="token"}'
    page = (
        'trio_sglang_sim_events_total{kind="token"} 7\ntrio_sglang_sim_events_total{kind="x"} 1\n'
    )
    assert parse_series(page, [series]) == {series: 7.0}
    with pytest.raises(ValueError, match="not a metric name"):
        Series.parse("two words")


@pytest.mark.parametrize(
    ("gauge", "kind"),
    [
        ("trio_sglang_engine_live_requests", "serve"),
        ('sglang:num_running_reqs{model_name="m"}', "sglang"),
        ('vllm:num_requests_running{model_name="m",engine="0"}', "vllm"),
        ('dynamo_frontend_inflight_requests{model="m"}', "dynamo-frontend"),
    ],
)
def test_each_server_is_recognised_by_its_in_flight_gauge(gauge: str, kind: str) -> None:
    found = detect_kind(f"# TYPE x gauge\n{gauge} 0\nprocess_cpu_seconds_total 1\n")
    assert found is not None
    assert found.name == kind
    assert found is KINDS[kind]


def test_an_engine_gauge_wins_over_a_frontend_gauge_on_one_page() -> None:
    """A Dynamo worker's system port: its own counters and SGLang's, passed through."""
    page = "dynamo_frontend_inflight_requests 1\nsglang:num_running_reqs 2\n"
    found = detect_kind(page)
    assert found is not None
    assert found.name == "sglang"
    assert detect_kind("process_cpu_seconds_total 1\n") is None


def test_what_each_kind_cannot_measure_is_said() -> None:
    assert KINDS["dynamo-frontend"].tokens is None
    assert KINDS["dynamo-frontend"].holds == "frontend"
    assert any("--decode-log-interval" in limit for limit in KINDS["sglang"].limits)
    assert KINDS["sglang"].tokens_lower_bound
    assert KINDS["vllm"].tokens_lower_bound
    assert KINDS["vllm"].stale_when_idle
    assert not KINDS["serve"].tokens_lower_bound


def test_gauges_and_a_counter_can_be_named() -> None:
    kind = custom_kind('in_flight=a_running+b_waiting{x="1,2"},tokens=c_total')
    assert [str(series) for series in kind.in_flight] == ["a_running", 'b_waiting{x="1,2"}']
    assert str(kind.tokens) == "c_total"
    assert custom_kind("in_flight=a").tokens is None
    for bad in ("a", "tokens=c", "in_flight=", "in_flight=a,other=b"):
        with pytest.raises(ValueError, match="--metrics"):
            custom_kind(bad)


# -- the attribution of releases ------------------------------------------------------------


def samples(*points: tuple[float, float]) -> list[Sample]:
    """Samples at (time, in flight), each scrape taking 2 ms from its time on."""
    return [Sample(at, at + 0.002, value, None) for at, value in points]


def test_releases_are_attributed_to_leaves_in_order() -> None:
    gauge = samples((0.0, 1), (0.1, 4), (1.0, 4), (1.01, 3), (2.05, 3), (2.1, 2), (2.2, 1))
    found = attribute_releases([1.0, 2.0, 2.01], baseline=1, samples=gauge)
    assert found.released_at == pytest.approx([1.011, 2.101, 2.201])
    assert found.peak == 3
    assert found.unseen == 0


def test_a_sample_sent_before_a_leave_cannot_show_its_release() -> None:
    # The gauge already dropped at 0.99 (another request's end): not this leave's.
    gauge = samples((0.5, 2), (0.99, 1), (1.05, 1))
    assert attribute_releases([1.0], baseline=1, samples=gauge).released_at == [
        pytest.approx(1.051)
    ]


def test_several_releases_in_one_sample_interval_share_that_sample() -> None:
    gauge = samples((0.0, 3), (1.0, 3), (1.02, 0))
    found = attribute_releases([1.001, 1.002, 1.003], baseline=0, samples=gauge)
    assert found.released_at == [pytest.approx(1.021)] * 3


def test_a_request_never_let_go_has_no_release_and_one_never_seen_is_counted() -> None:
    gauge = samples((0.0, 0), (0.5, 1), (1.5, 1), (3.0, 1))
    found = attribute_releases([1.0, 1.1], baseline=0, samples=gauge)
    assert found.released_at == [pytest.approx(1.501), None]
    assert found.unseen == 1  # two requests, the gauge never showed more than one


# -- phases and the report ------------------------------------------------------------------


def test_phases_parse_to_both_closes_unless_one_is_named() -> None:
    assert [p.name for p in parse_phases(["stay", "mid_stream", "before_headers:reset"])] == [
        "stay",
        "mid_stream:close",
        "mid_stream:reset",
        "before_headers:reset",
    ]
    assert len(ALL_PHASES) == 9
    for bad in ("soon", "stay:reset", "mid_stream:drop"):
        with pytest.raises(ValueError, match="unknown phase"):
            parse_phases([bad])


def test_percentiles_are_by_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert [percentile(values, p) for p in (0.5, 0.99, 1.0)] == [50.0, 99.0, 100.0]
    assert percentile([], 0.5) is None
