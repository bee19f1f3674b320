"""``trio-sglang dynamo-worker --engine sglang --device cpu`` behind NVIDIA Dynamo's frontend.

The real engine on this CPU as a backend of Dynamo's runtime: Dynamo 1.6.1's
own frontend tokenizes with the tiny model's tokenizer and routes to the
worker, all on loopback with discovery in a folder (``benchmarks/_dynamo_local.py``).
A client that leaves at the frontend must stop SGLang's real scheduler, read
from the worker's ``--metrics-port`` (``trio_sglang_scheduler_requests``, what
the scheduler publishes it holds). Marker ``real_engine``: ``nox -s
real-engine`` installs SGLang, Dynamo's runtime and its frontend together.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from _processes import gauge, wait_until

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s real-engine`")
pytest.importorskip("dynamo.frontend", reason="needs Dynamo's frontend: run `nox -s real-engine`")

from trio_sglang_harness import build_tiny_model

pytestmark = pytest.mark.real_engine

MODEL = "tiny-real"
#: The most a leave may take to empty the real scheduler, frontend to worker included;
#: the request asks for seconds of decoding.
STOPPED_WITHIN = 3.0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    folder = tmp_path_factory.mktemp("real-engine-dynamo")
    model = build_tiny_model(folder / "tiny-llama")
    from _dynamo_local import Deployment
    from _subprocesses import free_port

    with Deployment(folder) as running:
        running.start_frontend()
        port = free_port()
        command = running.trio_worker_command(MODEL, port, "--model-path", str(model))
        command += ["--engine", "sglang", "--device", "cpu"]
        running.start_worker(MODEL, command, MODEL, timeout=240)
        yield running, f"http://127.0.0.1:{port}"


def idle_within(metrics: str, bound: float) -> None:
    wait_until(
        "the real scheduler to hold no request",
        lambda: (
            not (
                gauge(metrics, "trio_sglang_scheduler_requests")
                or gauge(metrics, "trio_sglang_engine_live_requests")
            )
        ),
        bound,
    )


def decoding_within(metrics: str, bound: float) -> None:
    """Until the scheduler publishes that it runs the request (it publishes every few steps)."""
    wait_until(
        "the scheduler to show the request",
        lambda: gauge(metrics, "trio_sglang_scheduler_requests") == 1,
        bound,
    )


def test_a_completion_through_dynamos_frontend_on_the_real_engine(
    deployment: tuple[Any, str],
) -> None:
    running, metrics = deployment
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 5}
    done = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()
    assert done["choices"][0]["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 5
    idle_within(metrics, STOPPED_WITHIN)


def test_a_client_leaving_at_the_frontend_stops_the_real_scheduler(
    deployment: tuple[Any, str],
) -> None:
    running, metrics = deployment
    body = {
        "model": MODEL,
        "prompt": "hello world",
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        # Held, not left to the collector: a finalised line iterator closes the response.
        data = (line for line in response.iter_lines() if line.startswith("data: {"))
        next(data), next(data), next(data)
        decoding_within(metrics, STOPPED_WITHIN)  # for the client, still here
    idle_within(metrics, STOPPED_WITHIN)
    assert gauge(metrics, 'trio_sglang_cancellations_total{phase="mid_stream"}') == 1


def test_the_worker_publishes_the_real_engines_capabilities(deployment: tuple[Any, str]) -> None:
    running, _ = deployment
    cards = [
        json.loads(path.read_text())
        for path in (running.folder / "discovery").rglob("*")
        if path.is_file() and path.parent.name == "mdc"
    ]
    [config] = [
        card["card_json"]["runtime_config"]
        for card in cards
        if card.get("card_json", {}).get("display_name") == MODEL
    ]
    published = config["runtime_data"]["trio_sglang"]
    from sglang.version import __version__

    engine = published["engine"]
    assert {key: engine[key] for key in ("kind", "sglang_version", "disaggregation_mode")} == {
        "kind": "sglang",
        "sglang_version": __version__,
        "disaggregation_mode": None,
    }
    assert engine["sglang_semantics"]["version"] == __version__
    assert config["context_length"] == 8192  # the tiny model's, as SGLang read it
