"""Clients leaving two HTTP servers on the whole SGLang engine: SGLang's own, and ``serve``.

Each server runs over its own ``sglang.Engine`` on this CPU (the tiny model,
``_http_servers_cpu.py``), one after the other; the method is in
docs/benchmarks.md, "On the whole sglang.Engine, on the CPU" (its HTTP
servers' table). SGLang's ``/v1/loads`` and ``serve``'s
``trio_sglang_scheduler_requests`` are both the load snapshot SGLang's
scheduler publishes, every few decode steps, so a figure is good to a few
milliseconds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from _http_servers_cpu import SLOW_PROMPT
from _leaving_client import close_after
from _stats import percentiles
from _subprocesses import Process, free_port, gauge, healthy, wait_until

__all__ = [
    "SERVER_PHASES",
    "Server",
    "format_servers",
    "leave",
    "run_server_sweep",
    "started",
    "watch",
]

HERE = Path(__file__).resolve().parent
MAX_NEW_TOKENS = 400
#: How long, from the close, the scheduler is watched (the request decodes for about a second).
WINDOW = 2.5
#: How often it is looked at.
POLL = 0.002
SLOW_TOKENIZE = 0.5
#: When a client leaves, named after the phase it aims at (``trio_sglang._phases``), with
#: what puts it there: (the prompt, seconds after sending, data chunks read first).
SERVER_PHASES: dict[str, tuple[str, float, int]] = {
    "before_headers": ("hello world", 0.0, 0),
    "slow_tokenization": (SLOW_PROMPT + "hello world", 0.1, 0),
    "mid_stream": ("hello world", 0.0, 2),
}


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    holds: Callable[[], int]


def _sglang_holds(url: str) -> int:
    ranks = httpx.get(f"{url}/v1/loads", timeout=5).json()["loads"]  # one per DP rank
    return sum(int(r["num_running_reqs"]) + int(r["num_waiting_reqs"]) for r in ranks)


def _serve_holds(url: str) -> int:
    return int(gauge(url, "trio_sglang_scheduler_requests", default=0))


@contextmanager
def started(
    name: str, model: Path, folder: Path, *options: str, flags: Sequence[str] = ()
) -> Iterator[Server]:
    """``name``'s server on ``model``; ``options``: ``_http_servers_cpu.py``'s own, ``flags``:
    the server's (SGLang's flags, for both)."""
    port = free_port()
    flags = ["--model-path", str(model), "--port", str(port), *flags]
    if name == "sglang-server":
        kind, holds, flags = "sglang", _sglang_holds, [*flags, "--skip-server-warmup"]
    else:
        kind, holds = "trio-sglang", _serve_holds
    script = [sys.executable, str(HERE / "_http_servers_cpu.py")]
    command = [*script, "--slow-tokenize", str(SLOW_TOKENIZE), *options, kind, "--", *flags]
    process = Process(name, command, folder / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(f"{name} to answer", lambda: healthy(url), 300, process)
        yield Server(name, url, partial(holds, url))
    finally:
        process.stop(timeout=30)


def leave(server: Server, phase: str, *, max_new_tokens: int = MAX_NEW_TOKENS) -> float:
    """One client, gone at ``phase``; the moment it closed (``time.monotonic``)."""
    prompt, after, chunks = SERVER_PHASES[phase]
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    return close_after(server.url, {"text": prompt, "sampling_params": params}, after, chunks)


def watch(server: Server, left: float) -> tuple[float, bool, bool]:
    """From ``left``: seconds until the scheduler last showed the request, seen, still there."""
    last_busy, seen = left, False
    while (now := time.monotonic()) - left < WINDOW:
        if server.holds():
            last_busy, seen = now, True
        time.sleep(POLL)
    still = server.holds() > 0
    if still:  # let it end before the next client, so that each one is counted alone
        wait_until("the request left decoding to end", lambda: not server.holds(), 60)
    return last_busy - left, seen, still


def run_server_sweep(model: Path, folder: Path, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name in ("sglang-server", "trio-sglang-serve"):
        with started(name, model, folder) as server:
            leave(server, "mid_stream")  # a warm-up, not counted
            watch(server, time.monotonic())
            for phase in SERVER_PHASES:
                runs = [watch(server, leave(server, phase)) for _ in range(repeats)]
                rows.append(_row(name, phase, runs))
    return rows


def _row(name: str, phase: str, runs: Sequence[tuple[float, bool, bool]]) -> dict[str, Any]:
    return {
        "approach": name,
        "engine": "sglang-engine",
        "phase": phase,
        "cancels": len(runs),
        "until_idle_ms": percentiles([until * 1e3 for until, _, _ in runs]),
        "reached_scheduler": sum(seen for _, seen, _ in runs),
        "left_decoding": sum(still for _, _, still in runs),
    }


def format_servers(rows: list[dict[str, Any]]) -> str:
    lines = [
        "HTTP servers on the whole engine, a client closing its connection; the scheduler's",
        f"own load polled every {POLL * 1e3:.0f} ms for {WINDOW} s after the close",
        "",
        f"{'phase':<19} {'server':<18} {'n':>3} {'until idle p50 / p99':>21} "
        f"{'ran':>4} {'left decoding':>13}",
    ]
    for row in rows:
        idle = row["until_idle_ms"]
        lines.append(
            f"{row['phase']:<19} {row['approach']:<18} {row['cancels']:>3} "
            f"{idle['p50']:>10.1f} / {idle['p99']:<8.1f} {row['reached_scheduler']:>4} "
            f"{row['left_decoding']:>13}"
        )
    return "\n".join(lines)
