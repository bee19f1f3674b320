"""The benchmarks' modules, imported by the tests as the scripts import them.

A script in ``benchmarks/`` runs with that folder on ``sys.path`` and imports
its siblings by bare name (``import _report``), so a test module that tests
one puts the folder there too. It stays there only while the module-scoped
fixture lives, so that a test module which did not ask for it cannot import a
benchmark's module by accident; the tests of a module that did may import the
siblings by bare name, as the scripts do.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

__all__ = ["BENCHMARKS", "benchmark_fixture"]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_fixture(module: str) -> Callable[[], Iterator[ModuleType]]:
    """A module-scoped fixture that gives ``benchmarks/MODULE.py``, imported.

    Bind it to the fixture's name in the test module:
    ``bench = benchmark_fixture("cancel_latency")``.
    """

    @pytest.fixture(scope="module")
    def imported() -> Iterator[ModuleType]:
        with pytest.MonkeyPatch.context() as patch:
            patch.syspath_prepend(str(BENCHMARKS))
            yield importlib.import_module(module)

    return imported
