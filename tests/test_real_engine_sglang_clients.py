"""SGLang's own clients against ``serve --engine sglang``: its HTTP test kits and its benchmark.

A user who swaps SGLang's ``launch_server`` for ``trio-sglang serve --engine
sglang`` keeps SGLang's clients. Both servers run here on the tiny model
with the same flags (and the defaults otherwise), and:

- SGLang's own test kits (``tests/_sglang_kits.py``) run unchanged against
  each: every case that passes on SGLang's server passes on ``serve`` (on a
  random tiny model some fail on both, those that need its answers to make
  sense);
- SGLang's benchmark client (``python -m sglang.bench_serving``), which reads
  every non-empty line of a stream as JSON, completes every request against
  ``serve`` with its defaults, SSE heartbeats on, on the real engine and on
  the SimEngine (whose first token comes after several heartbeats).

Marker ``real_engine``: ``nox -s real-engine``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s real-engine`")

from _processes import Process, free_port, start_workers, wait_until
from trio_sglang_harness import build_tiny_model

pytestmark = pytest.mark.real_engine

ROOT = Path(__file__).resolve().parents[1]
#: SGLang's benchmark's backends: its native ``/generate``, and OpenAI's two routes.
BACKENDS = ("sglang", "sglang-oai", "sglang-oai-chat")
PROMPTS = 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-clients")


@pytest.fixture(scope="module")
def model(folder: Path) -> Path:
    return build_tiny_model(folder / "tiny-llama")


@pytest.fixture(scope="module")
def serve(folder: Path, model: Path) -> Iterator[str]:
    [(process, url)] = start_workers(
        ["serve"], folder, "--engine", "sglang", "--model-path", str(model), "--device", "cpu",
        timeout=240,
    )  # fmt: skip
    try:
        yield url
    finally:
        process.stop(timeout=30)


@pytest.fixture(scope="module")
def sglang_server(folder: Path, model: Path) -> Iterator[str]:
    """SGLang's ``launch_server`` on the same model and flags (``_http_servers_cpu.py``)."""
    port = free_port()
    command = [sys.executable, str(ROOT / "benchmarks" / "_http_servers_cpu.py"), "sglang", "--"]
    process = Process(
        "sglang", [*command, "--model-path", str(model), "--port", str(port)], folder / "sglang.log"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until("SGLang's server to answer /health", lambda: _healthy(url), 240, process)
        yield url
    finally:
        process.stop(timeout=30)


@pytest.fixture(scope="module")
def sim_serve(folder: Path) -> Iterator[str]:
    """``serve`` on the SimEngine, its first tokens after 0.3 s: three heartbeats each."""
    [(process, url)] = start_workers(["sim"], folder, "--sim-first-token-delay", "0.3")
    try:
        yield url
    finally:
        process.stop(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=30).status_code == 200
    except httpx.TransportError:
        return False


def kits(url: str, model: Path, out: Path) -> dict[str, str]:
    command = [sys.executable, str(ROOT / "tests" / "_sglang_kits.py"), url, str(model), str(out)]
    subprocess.run(command, check=True, timeout=900, capture_output=True)
    outcomes: dict[str, str] = json.loads(out.read_text())
    return outcomes


def test_sglangs_test_kits_pass_on_serve_wherever_they_pass_on_sglangs_server(
    serve: str, sglang_server: str, model: Path, folder: Path
) -> None:
    theirs = kits(sglang_server, model, folder / "kits-sglang.json")
    ours = kits(serve, model, folder / "kits-serve.json")
    passed = {name for name, outcome in theirs.items() if outcome == "passed"}
    assert len(passed) >= 20, theirs  # the kits ran, and SGLang's server passes most of them
    missing = {name: ours.get(name) for name in sorted(passed) if ours.get(name) != "passed"}
    assert not missing, f"pass on SGLang's server, not on serve: {missing}"


def bench_serving(url: str, model: Path, backend: str, out: Path) -> dict[str, object]:
    command = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", url,
        "--model", str(model), "--tokenizer", str(model), "--dataset-name", "random-ids",
        "--random-input-len", "64", "--random-output-len", "32", "--num-prompts", str(PROMPTS),
        "--max-concurrency", "8", "--disable-tqdm", "--output-file", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        command,
        timeout=600,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, object] = json.loads(out.read_text().splitlines()[-1])
    return result


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglangs_benchmark_completes_every_request_on_the_real_engine(
    serve: str, model: Path, folder: Path, backend: str
) -> None:
    result = bench_serving(serve, model, backend, folder / f"bench-{backend}.jsonl")
    assert result["completed"] == PROMPTS


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglangs_benchmark_completes_every_request_on_the_simengine(
    sim_serve: str, model: Path, folder: Path, backend: str
) -> None:
    result = bench_serving(sim_serve, model, backend, folder / f"bench-sim-{backend}.jsonl")
    assert result["completed"] == PROMPTS
