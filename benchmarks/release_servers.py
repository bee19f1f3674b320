"""SGLang's own HTTP server beside ``serve``, on the installed SGLang release, clients leaving.

    python benchmarks/release_servers.py [--repeats N] [--json PATH]

Measures whichever SGLang is importable: ``nox -s sglang-matrix -- --servers``
runs it on each release of the matrix; the method is in docs/engines.md,
"Every SGLang release from 0.5.10". Each server runs over the release's real
TokenizerManager and the stand-in scheduler (``_sglang_http.py``), one after
the other. What a client caused counts warm-up and ``n > 1`` children:

- ``reached``: requests the scheduler received;
- ``left_decoding``: of those, the ones still decoding at the end of the
  window, neither aborted nor finished: decoding for nobody;
- ``states_left``: states the TokenizerManager holds more than before the client.

A request left decoding is let run to its end before the next client.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from _http_servers_cpu import SLOW_PROMPT
from _leaving_client import close_after
from _output import write_json
from _serve_processes import wait_serving
from _subprocesses import Process, gauge, wait_until
from trio_sglang_harness import logged_since

HERE = Path(__file__).resolve().parent
MAX_NEW_TOKENS = 400
TOKEN_INTERVAL = 0.01  # 4 s to decode MAX_NEW_TOKENS: still decoding at the window's end
SLOW_TOKENIZE = 0.5
#: From the close: SGLang's server aborts a disconnected stream after 2 s.
WINDOW = 3.0
#: When a client leaves, named after the phase it aims at (``trio_sglang._phases``), with
#: what puts it there: (prompt, n, seconds after sending, data chunks read first).
PHASES: dict[str, tuple[str, int, float, int]] = {
    "before_headers": ("hello world", 1, 0.0, 0),
    "slow_tokenization": (SLOW_PROMPT + "hello world", 1, 0.1, 0),
    "mid_stream": ("hello world", 1, 0.0, 2),
    "n2_mid_stream": ("hello world", 2, 0.0, 2),
}
SERVERS = ("sglang-server", "trio-sglang-serve")


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    log: Path  # the stand-in scheduler's

    def states(self) -> int:
        if self.name == "sglang-server":
            return int(httpx.get(f"{self.url}/trio_sglang/states", timeout=5).json()["states"])
        return int(gauge(self.url, "trio_sglang_engine_live_requests", default=0))


@contextmanager
def started(name: str, folder: Path) -> Iterator[Server]:
    workdir = folder / name
    workdir.mkdir()
    kind = "sglang" if name == "sglang-server" else "trio-sglang"
    command = [
        sys.executable,
        str(HERE / "_sglang_http.py"),
        "--workdir",
        str(workdir),
        "--token-interval",
        str(TOKEN_INTERVAL),
        "--slow-tokenize",
        str(SLOW_TOKENIZE),
        "--server",
        kind,
    ]
    process = Process(name, command, folder / f"{name}.log")
    try:
        url = wait_serving(process, 300, health_timeout=60)
        yield Server(name, url, workdir / f"scheduler-{process.pid}.jsonl")
    finally:
        process.stop(timeout=30)


def _fates(events: list[dict[str, Any]]) -> dict[str, str]:
    """Each request the scheduler received: "decoding", "aborted" or "finished"."""
    fates: dict[str, str] = {}
    for event in events:
        rid, kind = event["rid"], event["kind"]
        if kind == "request":
            fates[rid] = "decoding"
        elif rid in fates and kind == "abort_applied":
            fates[rid] = "aborted"
        elif rid in fates and kind == "finished":
            fates[rid] = "finished"
    return fates


def one_client(server: Server, phase: str) -> tuple[int, int, int]:
    """(reached, left decoding, states left) for one client leaving at ``phase``."""
    prompt, n, after, chunks = PHASES[phase]
    states_before = server.states()
    since = server.log.stat().st_size
    params = {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "n": n}
    closed = close_after(server.url, {"text": prompt, "sampling_params": params}, after, chunks)
    time.sleep(max(0.0, closed + WINDOW - time.monotonic()))
    fates = _fates(logged_since(server.log, since))
    states_left = server.states() - states_before
    left = sum(fate == "decoding" for fate in fates.values())
    if left:  # let it end before the next client, so that each one is counted alone
        wait_until(
            "the requests left decoding to end",
            lambda: "decoding" not in _fates(logged_since(server.log, since)).values(),
            60,
        )
    return len(fates), left, states_left


def run(folder: Path, repeats: int) -> list[dict[str, Any]]:
    from trio_sglang._sglang._semantics import detect_semantics

    semantics = detect_semantics()
    rows = []
    for name in SERVERS:
        with started(name, folder) as server:
            one_client(server, "mid_stream")  # a warm-up, not counted
            for phase in PHASES:
                runs = [one_client(server, phase) for _ in range(repeats)]
                rows.append(
                    {
                        "sglang": semantics.version,
                        "close": semantics.close.value,
                        "server": name,
                        "phase": phase,
                        "clients": repeats,
                        "reached": sum(r for r, _, _ in runs),
                        "left_decoding": sum(d for _, d, _ in runs),
                        "states_left": sum(s for _, _, s in runs),
                    }
                )
            print(f"{name}: done", file=sys.stderr, flush=True)
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"SGLang {rows[0]['sglang']} (its close {rows[0]['close']}); clients closing their "
        f"connections, each watched {WINDOW} s",
        "",
        f"{'phase':<18} {'server':<18} {'clients':>7} {'reached':>7} "
        f"{'left decoding':>13} {'states left':>11}",
    ]
    for row in rows:
        lines.append(
            f"{row['phase']:<18} {row['server']:<18} {row['clients']:>7} {row['reached']:>7} "
            f"{row['left_decoding']:>13} {row['states_left']:>11}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="release_servers.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=3, help="clients per phase and server")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    with tempfile.TemporaryDirectory(prefix="release-servers-") as folder:
        rows = run(Path(folder), args.repeats)
    print(format_rows(rows))
    if args.json is not None:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
