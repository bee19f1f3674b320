"""The benchmarks' modules, imported by the tests as the scripts import them.

A script in ``benchmarks/`` runs with that folder on ``sys.path`` and imports
its siblings by bare name (``import _report``); pytest puts the folder there
for the tests too (``pythonpath`` in pyproject.toml). A test module takes a
benchmark's module through a fixture, so that collecting the tests imports
none of them (some bring matplotlib, or Dynamo).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

__all__ = ["BENCHMARKS", "benchmark_fixture"]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_fixture(module: str) -> Callable[[], ModuleType]:
    """A module-scoped fixture that gives ``benchmarks/MODULE.py``, imported.

    Bind it to the fixture's name in the test module:
    ``bench = benchmark_fixture("cancel_latency")``.
    """

    @pytest.fixture(scope="module")
    def imported() -> ModuleType:
        return importlib.import_module(module)

    return imported
