"""Subprocesses for the multi-worker tests: ``trio-sglang serve`` workers and a router.

All of it is the benchmarks' own (``benchmarks/_subprocesses.py``,
``benchmarks/_serve_processes.py``): every process logs to a file, every wait
is bounded, and ``stop`` always reaps.
"""

from __future__ import annotations

from _leaving_client import post_raw
from _serve_processes import ROUTERS, start_router, start_workers
from _subprocesses import (
    Process,
    answer_json,
    free_port,
    free_ports,
    gauge,
    healthy,
    served_url,
    wait_until,
)

__all__ = [
    "ROUTERS",
    "Process",
    "answer_json",
    "free_port",
    "free_ports",
    "gauge",
    "healthy",
    "post_raw",
    "served_url",
    "start_router",
    "start_workers",
    "wait_until",
]
