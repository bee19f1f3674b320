"""Cancels whose first abort SGLang's scheduler misses: SGLang's own server beside ``serve``.

    python benchmarks/missed_aborts.py [--cancels N] [--json PATH]

The method is in docs/benchmarks.md, "When SGLang's scheduler misses the
abort"; the fault is ``_http_servers_cpu.py --miss-first-abort``. The server's
log says how many aborts the scheduler missed, so that a server that never
aborted at all is not mistaken for one that aborted twice.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _http_servers_cpu import MISSED
from _output import write_json
from _server_sweep import WINDOW, Server, started, watch
from _server_sweep import leave as leave_at
from _stats import percentiles
from _subprocesses import gauge

__all__ = ["MAX_NEW_TOKENS", "leave", "main", "missed", "run"]

#: Seconds of decoding on this CPU: far past the window, a request left decoding shows.
MAX_NEW_TOKENS = 2000
SERVERS = ("sglang-server", "trio-sglang-serve")


def leave(server: Server) -> float:
    """One client, gone after two chunks; the moment it closed (``time.monotonic``)."""
    return leave_at(server, "mid_stream", max_new_tokens=MAX_NEW_TOKENS)


def missed(log: Path) -> int:
    """How many aborts the scheduler has missed so far, from the server's log."""
    return len(re.findall(re.escape(MISSED), log.read_text(errors="replace")))


def resent(server: Server) -> int:
    """``serve``'s count of requests whose abort it sent again (``abort_missed`` faults)."""
    missed = 'trio_sglang_engine_faults_total{kind="abort_missed"}'
    return int(gauge(server.url, missed, default=0))


def run(model: Path, folder: Path, cancels: int) -> list[dict[str, Any]]:
    from trio_sglang._sglang._semantics import detect_semantics

    version = detect_semantics().version
    rows = []
    for name in SERVERS:
        with started(name, model, folder, "--miss-first-abort") as server:
            log = folder / f"{name}.log"
            runs = []
            for i in range(cancels):
                runs.append(watch(server, leave(server)))
                print(f"{name}: {i + 1}/{cancels}", file=sys.stderr, flush=True)
            rows.append(
                {
                    "sglang": version,
                    "server": name,
                    "cancels": cancels,
                    "aborts_missed": missed(log),
                    "sent_again": resent(server) if name != "sglang-server" else 0,
                    "until_idle_ms": percentiles([until * 1e3 for until, _, _ in runs]),
                    "left_decoding": sum(still for _, _, still in runs),
                }
            )
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"SGLang {rows[0]['sglang']}, its scheduler missing each request's first abort; "
        f"clients leaving after two chunks of {MAX_NEW_TOKENS} tokens, each watched {WINDOW} s",
        "",
        f"{'server':<18} {'cancels':>7} {'missed':>6} {'sent again':>10} "
        f"{'until idle p50 / p99 ms':>24} {'left decoding':>13}",
    ]
    for row in rows:
        idle = row["until_idle_ms"]
        lines.append(
            f"{row['server']:<18} {row['cancels']:>7} {row['aborts_missed']:>6} "
            f"{row['sent_again']:>10} {idle['p50']:>13.1f} / {idle['p99']:<8.1f} "
            f"{row['left_decoding']:>13}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="missed_aborts.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cancels", type=int, default=50, help="clients per server")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.cancels < 1:
        parser.error("--cancels must be at least 1")
    from trio_sglang_harness import build_tiny_model

    started_at = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="missed-aborts-") as folder:
        model = build_tiny_model(Path(folder) / "tiny-llama")
        rows = run(model, Path(folder), args.cancels)
    print(format_rows(rows))
    print(f"({time.monotonic() - started_at:.0f} s)", file=sys.stderr)
    if args.json is not None:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
