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
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s real-engine`")

from _processes import Process, free_port, healthy, start_workers, wait_until
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
        wait_until("SGLang's server to answer /health", lambda: healthy(url), 240, process)
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


#: Runs, on each server, of a case that passed on SGLang's server and failed on ``serve``.
RERUNS = 10


def kits(
    url: str, model: Path, out: Path, only: Sequence[str] = (), times: int = 1
) -> dict[str, list[str]]:
    """Each case's outcomes (``tests/_sglang_kits.py``): all cases once, or ``only`` ``times``."""
    command = [sys.executable, str(ROOT / "tests" / "_sglang_kits.py"), url, str(model), str(out)]
    command += [*only, "--times", str(times)]
    subprocess.run(command, check=True, timeout=900, capture_output=True)
    outcomes: dict[str, list[str]] = json.loads(out.read_text())
    return outcomes


def test_sglangs_test_kits_pass_on_serve_wherever_they_pass_on_sglangs_server(
    serve: str, sglang_server: str, model: Path, folder: Path
) -> None:
    """Some cases sample (grammars at temperature 1 on a random model), and one run of
    such a case passes or fails on either server by chance. So a case that passed on
    SGLang's server and failed on ``serve`` runs ``RERUNS`` more times on each, and
    fails here if it never passes on ``serve`` while passing in at least half its runs
    on SGLang's server. Chance alone does that to one case in 1,100 at worst (a case
    that passes 29% of the time), and a case that ``serve`` breaks and SGLang's server
    passes more often than not is caught."""
    theirs = kits(sglang_server, model, folder / "kits-sglang.json")
    passed = {name for name, outcomes in theirs.items() if outcomes == ["passed"]}
    assert len(passed) >= 20, theirs  # the kits ran, and SGLang's server passes most of them
    ours = kits(serve, model, folder / "kits-serve.json")
    missing = sorted(name for name in passed if ours[name] != ["passed"])
    if not missing:
        return
    theirs = kits(sglang_server, model, folder / "kits-sglang-again.json", missing, RERUNS)
    ours = kits(serve, model, folder / "kits-serve-again.json", missing, RERUNS)
    broken = {
        name: (f"{theirs[name].count('passed')} of {RERUNS} on SGLang's server", ours[name][-1])
        for name in missing
        if "passed" not in ours[name] and theirs[name].count("passed") >= RERUNS / 2
    }
    assert not broken, f"pass on SGLang's server, never on serve: {broken}"


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
@pytest.mark.parametrize("engine", ["serve", "sim_serve"])  # the real engine, the SimEngine
def test_sglangs_benchmark_completes_every_request(
    request: pytest.FixtureRequest, model: Path, folder: Path, engine: str, backend: str
) -> None:
    url = request.getfixturevalue(engine)
    result = bench_serving(url, model, backend, folder / f"bench-{engine}-{backend}.jsonl")
    assert result["completed"] == PROMPTS


#: What differs between two servers answering the same request: ids, clocks, and the
#: prefix cache (each server's own history).
VOLATILE = frozenset(
    {
        "id",
        "created",
        "e2e_latency",
        "response_sent_to_client_ts",
        "cached_tokens",
        "cached_tokens_details",
        "prompt_tokens_details",
        "queue_time",
        "model",
    }
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0}
#: The same requests to both servers, greedy: every field of the answer must match.
PARITY = {
    "generate": (
        "/generate",
        {"text": "hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    ),
    "generate, n 2, logprobs": (
        "/generate",
        {
            "text": "hello",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    ),
    "completion, echo, logprobs, stop": (
        "/v1/completions",
        {
            "prompt": "hello",
            "max_tokens": 8,
            "temperature": 0,
            "echo": True,
            "logprobs": 2,
            "stop": ["e"],
        },
    ),
    "chat": ("/v1/chat/completions", CHAT),
    "chat, logprobs": ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}),
    "chat, tools required": (
        "/v1/chat/completions",
        {**CHAT, "max_tokens": 32, "tools": TOOLS, "tool_choice": "required"},
    ),
    "chat, tool named": (
        "/v1/chat/completions",
        {
            **CHAT,
            "max_tokens": 32,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "weather"}},
        },
    ),
    "chat, json schema": (
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                },
            },
        },
    ),
    "chat, bad temperature": ("/v1/chat/completions", {**CHAT, "temperature": "hot"}),
    "chat, no messages": ("/v1/chat/completions", {"max_tokens": 4}),
    "generate, no prompt": ("/generate", {"sampling_params": {"max_new_tokens": 4}}),
    "generate, a LoRA adapter without LoRA": (
        "/generate",
        {"text": "hello", "lora_path": "adapter", "sampling_params": {"max_new_tokens": 4}},
    ),
    "generate, hidden states while off": (
        "/generate",
        {"text": "hello", "return_hidden_states": True, "sampling_params": {"max_new_tokens": 4}},
    ),
    "generate, past the context length": (
        "/generate",
        {"input_ids": [5] * 9000, "sampling_params": {"max_new_tokens": 4}},
    ),
    "tokenize": ("/tokenize", {"prompt": "hello world"}),
    "detokenize": ("/detokenize", {"tokens": [10, 11, 12]}),
}


def steady(value: object) -> object:
    """``value`` without what two servers answer differently to the same request."""
    if isinstance(value, dict):
        return {key: steady(item) for key, item in value.items() if key not in VOLATILE}
    if isinstance(value, list):
        return [steady(item) for item in value]
    return value


def answers(url: str, path: str, body: dict[str, object]) -> tuple[int, object]:
    response = httpx.post(f"{url}{path}", json=body, timeout=120)
    try:
        return response.status_code, steady(response.json())
    except ValueError:
        return response.status_code, response.text


@pytest.mark.parametrize("case", PARITY)
def test_serve_answers_as_sglangs_server_does_field_by_field(
    serve: str, sglang_server: str, case: str
) -> None:
    path, body = PARITY[case]
    ours, theirs = answers(serve, path, body), answers(sglang_server, path, body)
    assert ours == theirs, differences(ours, theirs)


def differences(ours: object, theirs: object, where: str = "") -> list[str]:
    """Where two answers differ, and how: ``[1].meta_info.id: 'a' != 'b'``."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [
            line
            for key in sorted(ours.keys() | theirs.keys())
            for line in differences(
                ours.get(key, "<absent>"), theirs.get(key, "<absent>"), f"{where}.{key}"
            )
        ]
    if (
        isinstance(ours, list | tuple)
        and isinstance(theirs, list | tuple)
        and len(ours) == len(theirs)
    ):
        return [
            line
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
            for line in differences(a, b, f"{where}[{i}]")
        ]
    return [] if ours == theirs else [f"{where}: {ours!r:.200} != {theirs!r:.200}"]


def test_streams_say_the_same_on_both_servers(serve: str, sglang_server: str) -> None:
    """The same text, the same shape of event, the same end: how the tokens are cut into
    events depends on when the scheduler ran, on either server."""
    body = {**CHAT, "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}

    def stream(url: str) -> tuple[str, set[str], list[object]]:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        events = [steady(json.loads(line)) for line in lines[:-1]]
        deltas = [event["choices"][0]["delta"] for event in events if event["choices"]]
        text = "".join(delta.get("content") or "" for delta in deltas)
        shapes = {json.dumps(sorted(delta)) for delta in deltas}
        return text, shapes, events[-2:]  # the finish reason, then the usage

    assert stream(serve) == stream(sglang_server)
