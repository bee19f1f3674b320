"""A Dynamo deployment on one machine: the frontend and workers as subprocesses.

No etcd and no NATS: discovery in a folder (``DYN_DISCOVERY_BACKEND=file``),
TCP request and response planes, ZMQ events, and every host on 127.0.0.1.
Each process logs to a file (no pipe to fill), every wait is bounded, and
``close`` always reaps every process (``_subprocesses.py``). Used by
``dynamo_cancel.py`` and by the tests of ``trio-sglang dynamo-worker``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from _subprocesses import Process, answer_json, free_port, wait_until

__all__ = ["Deployment", "local_env", "loopback_env"]

#: Dynamo's log filter unless ``DYN_LOG`` is set: warnings, and the runtime's steps on its
#: way up (discovery, then the request plane), a handful of lines a process. A process that
#: hangs while it starts shows how far it got; its retries are warnings already.
STARTUP_LOG = (
    "warn,dynamo_runtime::distributed=info,dynamo_runtime::pipeline::network::manager=info"
)


def local_env(discovery: Path) -> dict[str, str]:
    """This environment, with Dynamo's runtime kept on loopback and discovery in ``discovery``."""
    return {**loopback_env(), "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(discovery)}


def loopback_env() -> dict[str, str]:
    """This environment, with Dynamo's planes on TCP and ZMQ, every host on loopback."""
    return {
        **os.environ,
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_RESPONSE_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        # Without these the runtime binds to the machine's primary interface.
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "DYN_LOG": os.environ.get("DYN_LOG", STARTUP_LOG),
    }


class Deployment:
    """Dynamo's frontend on ``port`` and the workers started with ``start_worker``."""

    def __init__(
        self, folder: Path, *, python: str = sys.executable, env: Mapping[str, str] | None = None
    ) -> None:
        """``env``: the processes' environment (default: ``local_env``, file discovery)."""
        self.folder = folder
        self.python = python
        self.env = local_env(folder / "discovery") if env is None else dict(env)
        (folder / "discovery").mkdir(parents=True, exist_ok=True)
        self.processes: list[Process] = []
        self.url = ""

    def start_frontend(
        self, *args: str, timeout: float = 60.0, beside: Sequence[Process] = ()
    ) -> str:
        """``python -m dynamo.frontend ARGS`` on loopback; its URL once it answers.

        ``beside``: what it needs to start (etcd, nats-server), watched with it,
        their logs' ends in the message if it does not answer in time.
        """
        port = free_port()
        command = [self.python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1"]
        frontend = self._start("frontend", [*command, "--http-port", str(port), *args])
        self.url = f"http://127.0.0.1:{port}"
        wait_until(
            "the frontend to answer",
            lambda: self._models() is not None,
            timeout,
            frontend,
            *beside,
        )
        return self.url

    def start_worker(
        self, name: str, command: Sequence[str], model: str, timeout: float = 60.0
    ) -> Process:
        """A worker process; returned once the frontend lists ``model``."""
        worker = self._start(name, command)
        wait_until(
            f"the frontend to list {model}",
            lambda: model in (self._models() or ()),
            timeout,
            worker,
        )
        return worker

    def trio_worker_command(self, model: str, metrics_port: int, *args: str) -> list[str]:
        """``trio-sglang dynamo-worker`` for ``model``, its metrics on ``metrics_port``.

        Each model gets a component of its own (named after it): workers of
        one endpoint are one pool to the router, whatever model they serve.
        """
        command = [self.python, "-m", "trio_sglang", "dynamo-worker", "--model-name", model]
        return [*command, "--component", model, "--metrics-port", str(metrics_port), *args]

    def _start(self, name: str, command: Sequence[str]) -> Process:
        process = Process(name, command, self.folder / f"{name}.log", self.env)
        self.processes.append(process)
        return process

    def _models(self) -> list[str] | None:
        listing = answer_json(f"{self.url}/v1/models")
        return None if listing is None else [model["id"] for model in listing.get("data", ())]

    def close(self) -> None:
        """Workers first (they unregister), then the frontend; every process reaped."""
        for process in reversed(self.processes):
            process.stop(timeout=15)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
