"""Patch one of SGLang's modules as it loads, in this process and in those SGLang spawns.

SGLang's scheduler is a process of its own, started by ``multiprocessing``'s
spawn, which imports the parent's main script again (``_http_servers_cpu.py``)
and so runs what that script does at import. A patch that must hold in the
scheduler is therefore installed at import, as a finder on ``sys.meta_path``
that lets the path finder load the module and then patches it; a module that
is already loaded is patched at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["patch_on_load"]


def patch_on_load(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Run ``patch`` on module ``name`` once it has loaded (now, if it has); idempotent."""
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(
        isinstance(finder, _PatchOnLoad) and finder.name == name for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _PatchOnLoad(name, patch))


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Finds one module as the path finder does, and patches it once it ran."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name = name
        self._patch = patch

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            self._patch(module)

        loader.exec_module = exec_module
        return spec
