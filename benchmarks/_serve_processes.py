"""``trio-sglang serve`` workers and a router in front of them, as processes on loopback.

Shared by the benchmarks that cross a hop (``hop_cancel.py``) and the
multi-worker tests (``tests/_processes.py`` re-exports it). Built on
``_subprocesses``: every process logs to a file, every wait is bounded, and
``stop`` always reaps.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from _subprocesses import Process, answer_json, free_ports, healthy, served_url, wait_until

__all__ = ["ROUTERS", "start_router", "start_workers", "wait_serving"]

#: The routers SGLang deployments put in front of their workers, by name: the module each
#: runs as (``python -m ...``). Both take the same options for what the tests use: smg
#: (the SGLang model gateway) is sglang-router's successor.
ROUTERS: dict[str, tuple[str, ...]] = {
    "sglang-router": ("sglang_router.launch_router",),
    "smg": ("smg", "launch"),
}


def wait_serving(process: Process, timeout: float, health_timeout: float | None = None) -> str:
    """The URL ``process`` reports ("serving ... on URL"), once /health answers 200 there
    (within ``health_timeout``, by default ``timeout``)."""
    wait_until(
        f"{process.name} to report its URL",
        lambda: served_url(process.output()) is not None,
        timeout,
        process,
    )
    url = served_url(process.output())
    assert url is not None
    wait_until(
        f"{process.name} to answer /health",
        lambda: healthy(url),
        timeout if health_timeout is None else health_timeout,
        process,
    )
    return url


def start_workers(
    names: Sequence[str], log_dir: Path, *args: str, timeout: float = 30.0
) -> list[tuple[Process, str]]:
    """``python -m trio_sglang serve --port 0 ARGS`` once per name, started together.

    Returns each process and its URL once its /health answers 200.
    """
    command = [sys.executable, "-m", "trio_sglang", "serve", "--port", "0", *args]
    started: list[Process] = []
    try:
        for name in names:
            started.append(Process(name, command, log_dir / f"{name}.log"))
        workers = [(process, wait_serving(process, timeout)) for process in started]
    except BaseException:
        for process in started:
            process.stop()
        raise
    return workers


def start_router(
    log_dir: Path,
    worker_urls: Sequence[str],
    *args: str,
    timeout: float = 30.0,
    watched: Sequence[Process] = (),
    router: str = "sglang-router",
) -> tuple[Process, str]:
    """``router`` (a name in ROUTERS) on loopback in front of ``worker_urls``.

    Returns once its ``/workers`` lists every worker as healthy; fails early if
    the router or one of the ``watched`` processes (the workers) exits.
    """
    port, metrics_port = free_ports(2)
    command = [sys.executable, "-m", *ROUTERS[router], "--worker-urls", *worker_urls]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    process = Process(router, [*command, *args], log_dir / f"{router}.log")
    url = f"http://127.0.0.1:{port}"

    def all_registered() -> bool:
        listing = answer_json(f"{url}/workers")
        if not isinstance(listing, dict):
            return False
        listed = {w.get("url") for w in listing.get("workers", []) if w.get("is_healthy")}
        return set(worker_urls) <= listed

    try:
        wait_until(
            "the router to register every worker", all_registered, timeout, process, *watched
        )
    except BaseException:
        process.stop()
        raise
    return process, url
