"""trio-sglang workers in a Dynamo deployment, read through their own metrics.

Shared by the tests that run Dynamo's frontend and ``trio-sglang dynamo-worker``
processes: with file discovery (``test_dynamo.py``) and in cluster mode, on
etcd and NATS (``test_cluster.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from _processes import free_port

__all__ = ["RELEASE_BOUND", "Worker", "run_readme_block", "start_worker"]

#: Generous: a request nobody stopped runs for tens of seconds here.
RELEASE_BOUND = 5.0


class Worker:
    """One worker process and its metrics URL."""

    def __init__(self, process: Any, metrics_port: int, model: str) -> None:
        self.process = process
        self.metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        self.model = model

    def sample(self, name: str, **labels: str) -> float:
        """The value of one series in the worker's metrics (0 if absent)."""
        text = httpx.get(self.metrics, timeout=5).text
        wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
        series = f"{name}{{{wanted}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def live(self) -> float:
        return self.sample("trio_sglang_engine_live_requests")

    def events(self, kind: str) -> float:
        return self.sample("trio_sglang_sim_events_total", kind=kind)

    def outcomes(self, outcome: str) -> float:
        return self.sample("trio_sglang_requests_total", endpoint="dynamo", outcome=outcome)


def start_worker(deployment: Any, model: str, *args: str, name: str | None = None) -> Worker:
    port = free_port()
    command = deployment.trio_worker_command(model, port, *args)
    process = deployment.start_worker(name or model, command, model)
    return Worker(process, port, model)


#: Between a README block's start of its processes and its curl: what a person does by eye.
_WAIT_FOR_MODEL = (
    "for _ in $(seq 600); do curl -sf http://127.0.0.1:{port}/v1/models | "
    "grep -q trio-sglang-sim && break; sleep 0.1; done"
)


def run_readme_block(
    block: str, replacements: Mapping[str, str], port: int, jobs: int, cwd: Path
) -> Any:
    """A README block of Dynamo processes and a curl, as written but for ``replacements``
    (``port`` is the frontend's), this environment standing in for ``.venv-dynamo``;
    the curl's answer, once the ``jobs`` background processes are stopped."""
    script = block.replace(".venv-dynamo/bin/", f"{Path(sys.executable).parent}/")
    for old, new in replacements.items():
        script = script.replace(old, new)
    script = script.replace("\ncurl", f"\n{_WAIT_FOR_MODEL.format(port=port)}\ncurl")
    stop = " ".join(f"%{job}" for job in range(1, jobs + 1))
    done = subprocess.run(
        ["bash", "-c", f"set -e\ncd {cwd}\n{script}\nkill {stop}; wait"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
