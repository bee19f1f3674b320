"""``serve`` hosting the installed release's own server application answers as that server does.

``serve --engine sglang`` runs SGLang's own application over the lifecycle
(``_sglang/_server_app.py``), on every supported release. Here both servers run on
the installed release's real TokenizerManager and the harness's stand-in
scheduler (``benchmarks/_sglang_http.py``: ``--server sglang``, SGLang's
own, as ``launch_server`` starts it, and ``--server hosted``, once on each
asyncio loop ``serve --loop`` offers), and the same requests go to each. The
stand-in's tokens are the same for the same request, so the answers must be
too, up to ids and timestamps: text, token ids, finish reasons, usage. A
stream may group its tokens into other events on the two servers, so a
stream is compared put together (the harness's TokenizerManager streams
increments: both streams' events are joined).

Marked ``sglang``: it runs in ``nox -s sglang`` and on each release of
``nox -s sglang-matrix``. About 70 s a release.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s sglang`")

from _load_server import ServerProcess, open_server

pytestmark = pytest.mark.sglang

SGLANG_HTTP = Path(__file__).resolve().parents[1] / "benchmarks" / "_sglang_http.py"
SERVERS = ("sglang", "hosted")
LOOPS = ("guest", "trio-asyncio")
#: Four tokens each (the stand-in scheduler stops at ``max_new_tokens``).
GENERATE = {"text": "hello", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
CHAT = {
    "model": "default",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 4,
    "ignore_eos": True,
}
COMPLETION = {"model": "default", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}


@asynccontextmanager
async def sglang_http(kind: str, workdir: Path, loop: str) -> AsyncIterator[ServerProcess]:
    command = [sys.executable, str(SGLANG_HTTP), "--workdir", str(workdir), "--server", kind]
    args = ["--token-interval", "0.01", "--first-token-delay", "0.01", "--loop", loop]
    async with open_server(args, start_timeout=180, http_timeout=30, command=command) as server:
        yield server


@pytest.fixture(scope="module")
def sglang_answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """SGLang's own server's answers (its ``--loop`` is unused: uvicorn on uvloop)."""
    return trio.run(_ask, "sglang", tmp_path_factory.mktemp("sglang"), "guest")


@pytest.fixture(scope="module", params=LOOPS)
def answers(
    request: pytest.FixtureRequest,
    sglang_answers: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    """Each server's answers to the same requests (the servers run one after the other)."""
    loop: str = request.param
    hosted = trio.run(_ask, "hosted", tmp_path_factory.mktemp(f"hosted-{loop}"), loop)
    return {"sglang": sglang_answers, "hosted": hosted}


async def _ask(kind: str, workdir: Path, loop: str) -> dict[str, Any]:
    async with sglang_http(kind, workdir, loop) as server:
        url = server.url
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return {
                "generate": (await client.post("/generate", json=GENERATE)).json(),
                "generate stream": await _events(client, "/generate", GENERATE),
                "chat": (await client.post("/v1/chat/completions", json=CHAT)).json(),
                "chat stream": await _events(client, "/v1/chat/completions", CHAT),
                "completion": (await client.post("/v1/completions", json=COMPLETION)).json(),
            }


async def _events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    events = []
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def test_a_generate_answer_is_the_same(answers: dict[str, dict[str, Any]]) -> None:
    sglang, hosted = (answers[kind]["generate"] for kind in SERVERS)
    assert hosted["text"] == sglang["text"]
    assert len(sglang["text"].split()) == 4
    assert hosted["output_ids"] == sglang["output_ids"]
    for key in ("finish_reason", "prompt_tokens", "completion_tokens"):
        assert hosted["meta_info"][key] == sglang["meta_info"][key], key


def test_a_generate_stream_says_the_same_put_together(answers: dict[str, dict[str, Any]]) -> None:
    sglang, hosted = (_put_together(answers[kind]["generate stream"]) for kind in SERVERS)
    assert hosted == sglang
    assert len(sglang[0].split()) == 4


def test_a_chat_answer_is_the_same(answers: dict[str, dict[str, Any]]) -> None:
    sglang, hosted = (answers[kind]["chat"] for kind in SERVERS)
    assert hosted["choices"][0]["message"] == sglang["choices"][0]["message"]
    assert hosted["choices"][0]["finish_reason"] == sglang["choices"][0]["finish_reason"]
    assert hosted["usage"] == sglang["usage"]


def test_a_chat_stream_says_the_same_put_together(answers: dict[str, dict[str, Any]]) -> None:
    sglang, hosted = (answers[kind]["chat stream"] for kind in SERVERS)

    def content(events: list[Any]) -> tuple[str, list[Any]]:
        choices = [choice for event in events for choice in event.get("choices", ())]
        text = "".join(choice["delta"].get("content") or "" for choice in choices)
        return text, [c["finish_reason"] for c in choices if c["finish_reason"] is not None]

    assert content(hosted) == content(sglang)
    # Not four words on every release: 0.5.10's own chat route reads the increments its
    # TokenizerManager streams here as totals, and says only the first; so does serve.
    assert content(sglang)[0]


def test_a_completion_is_the_same(answers: dict[str, dict[str, Any]]) -> None:
    sglang, hosted = (answers[kind]["completion"] for kind in SERVERS)
    assert hosted["choices"][0]["text"] == sglang["choices"][0]["text"]
    assert hosted["choices"][0]["finish_reason"] == sglang["choices"][0]["finish_reason"]
    assert hosted["usage"] == sglang["usage"]


def _put_together(events: list[Any]) -> tuple[str, list[int], Any]:
    """A native stream's text and token ids, each event's joined, and its last finish reason."""
    text = "".join(event["text"] for event in events)
    ids = [token for event in events for token in event["output_ids"]]
    return text, ids, events[-1]["meta_info"]["finish_reason"]
