"""``open_sglang_harness``: the real TokenizerManager and a stand-in scheduler, no GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import trio

from trio_sglang._asyncio_bridge._asyncio_side import LoopKind

from ._chat import ChatPrompts
from ._peer import DisaggSetup
from ._protocol import ANSWER
from ._scenarios import Observation, Scenario

__all__ = ["Caller", "SGLangHarness", "open_sglang_harness"]

#: Who makes a scenario's request in the host (see ``SGLangHarness.run``).
Caller = Literal["trio-sglang", "dynamo-1.6"]


class SGLangHarness:
    """A running harness: send it scenarios, get back what happened."""

    def __init__(self, process: trio.Process, lines: _Lines, ready: dict[str, Any]) -> None:
        self._process = process
        self._lines = lines
        #: The worker's capabilities over the real TokenizerManager.
        self.capabilities: dict[str, Any] = ready["capabilities"]
        #: The class of the engine's TokenizerManager (``TokenizerWorker`` with several).
        self.tokenizer_manager: str = ready["tokenizer_manager"]

    async def run(self, scenario: Scenario, caller: Caller = "trio-sglang") -> Observation:
        """Run one scenario in the host process (bound it with a cancel scope).

        ``caller`` is who makes the request: trio-sglang's worker over
        ``SGLangEngine``, or NVIDIA Dynamo 1.6.1's own SGLang handler (a
        harness opened with ``dynamo=True``), on the same TokenizerManager.
        """
        await self._send({"op": "run", "scenario": scenario.to_json(), "caller": caller})
        answer = await self._lines.answer()
        if "error" in answer:
            raise RuntimeError(f"scenario {scenario.name!r} failed in the host: {answer['error']}")
        return Observation(**answer["observation"])

    async def run_measured(self, scenario: Scenario, tries: int = 3) -> Observation:
        """``run``, again while the run measured no cancel (``Observation.missed``: a machine
        stalled so long that the cancel came after the request had finished), at most
        ``tries`` times: a check is then neither failed by load nor passed by a cancel
        that stopped nothing. Raises ``AssertionError`` if every run missed."""
        for _ in range(tries):
            seen = await self.run(scenario)
            if not seen.missed:
                return seen
        raise AssertionError(
            f"scenario {scenario.name!r}: its cancel came too late to stop anything in all "
            f"{tries} runs (a machine stalled for longer than the request lasts)"
        )

    async def chat(self, body: dict[str, Any]) -> ChatPrompts:
        """One OpenAI chat body through trio-sglang's chat route and SGLang's (``ChatPrompts``)."""
        await self._send({"op": "chat", "body": body})
        answer = await self._lines.answer()
        if "error" in answer:
            raise RuntimeError(f"the chat request failed in the host: {answer['error']}")
        return ChatPrompts(**answer["chat"])

    async def _send(self, command: dict[str, Any]) -> None:
        assert self._process.stdin is not None
        await self._process.stdin.send_all(json.dumps(command).encode() + b"\n")


class _Lines:
    """The host's answers: its stdout lines that carry the answer prefix."""

    def __init__(self, process: trio.Process) -> None:
        assert process.stdout is not None
        self._stdout = process.stdout
        self._buffer = b""

    async def answer(self) -> dict[str, Any]:
        while True:
            line = await self._line()
            if line.startswith(ANSWER):
                data: dict[str, Any] = json.loads(line[len(ANSWER) :])
                return data

    async def _line(self) -> str:
        while b"\n" not in self._buffer:
            chunk = await self._stdout.receive_some()
            if not chunk:
                raise RuntimeError("the harness host exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


@asynccontextmanager
async def open_sglang_harness(
    *,
    workdir: Path | None = None,
    first_token_delay: float = 0.2,
    token_interval: float = 0.05,
    disagg: DisaggSetup | None = None,
    chat_template: str | None = None,
    dynamo: bool = False,
    real_engine: bool = False,
    tokenizer_workers: int = 1,
    loop: LoopKind = "trio-asyncio",
    start_timeout: float = 300.0,
) -> AsyncIterator[SGLangHarness]:
    """Start the host process (real TokenizerManager, stand-in scheduler) and stop it after.

    Needs the ``sglang`` extra (CPU is enough). ``workdir`` keeps the tiny
    model between runs; a temporary directory is used otherwise. The
    scheduler's first output comes ``first_token_delay`` seconds after a
    request reaches it, then one token every ``token_interval`` seconds.
    ``disagg`` makes the TokenizerManager and the scheduler a prefill or a
    decode server's, the other side played by its peer script.
    ``chat_template`` is SGLang's ``--chat-template`` (a Jinja file or a name).
    ``dynamo`` also opens Dynamo 1.6.1's SGLang handler in the host (the
    ``bench-dynamo`` extra and ``ai-dynamo``), for ``run(..., caller="dynamo-1.6")``.
    ``real_engine`` runs the whole ``sglang.Engine`` on the CPU instead of the
    stand-in scheduler (its own timing: the two delays do not apply); each
    observation then also says what the scheduler still held
    (``Observation.scheduler_held_after``). ``tokenizer_workers`` is its
    ``tokenizer_worker_num``: above 1, SGLang routes between tokenizer workers,
    and the worker drives the one in the host. ``loop`` is where the host runs
    SGLang's asyncio code (``serve --loop``): trio-asyncio's loop inside trio,
    or the uvloop the host's trio run is the guest of.
    """
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(scratch) if workdir is None else workdir
        where.mkdir(parents=True, exist_ok=True)
        process = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "trio_sglang_harness._host",
                "--workdir",
                str(where),
                "--first-token-delay",
                str(first_token_delay),
                "--token-interval",
                str(token_interval),
                *(() if disagg is None else ("--disagg", disagg.to_text())),
                *(() if chat_template is None else ("--chat-template", chat_template)),
                *(("--dynamo",) if dynamo else ()),
                *(("--real-engine",) if real_engine else ()),
                *(("--tokenizer-workers", str(tokenizer_workers)) if real_engine else ()),
                "--loop",
                loop,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            lines = _Lines(process)
            with trio.fail_after(start_timeout):
                ready = await lines.answer()
            harness = SGLangHarness(process, lines, ready)
            yield harness
            await harness._send({"op": "quit"})
            with trio.move_on_after(20, shield=True):
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                with trio.move_on_after(5, shield=True):
                    await process.wait()
