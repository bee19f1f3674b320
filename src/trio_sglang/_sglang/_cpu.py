"""SGLang's CPU engine (``device="cpu"``): what has to be in place before SGLang loads.

The whole ``sglang.Engine`` (scheduler, detokenizer, a model's forward) runs on
a CPU with no GPU, but only if three things hold, none of which a user should
have to know:

- ``SGLANG_USE_CPU_ENGINE=1`` is in the environment before SGLang is first
  imported: SGLang decides ``is_cpu()`` once, at import, and caches it; without
  it the scheduler takes the CUDA path and dies importing CUDA-only modules.
- ``sgl_kernel`` imports. SGLang's CPU code imports eight names from it at
  module load; no package index ships a CPU build, and on a CPU without AMX
  none of the eight is ever called. The project ships an import-only stand-in
  (``_sgl_kernel_standin/``) and puts it on the path, for this process and
  for the scheduler and detokenizer processes SGLang spawns, only when no real
  ``sgl_kernel`` can be imported: a working one is never shadowed, and a CUDA
  build that cannot load on this machine (what a full ``pip install sglang``
  brings) is.
- A few server arguments that suit a CPU (``CPU_DEFAULTS``), each overridden
  by the same argument given explicitly.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = ["CPU_DEFAULTS", "CPU_ENGINE_ENV", "prepare_cpu_engine", "with_cpu_defaults"]

#: The variable SGLang reads (once, at import) to take its CPU code paths.
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"

#: The folder that holds the stand-in ``sgl_kernel`` package.
_STANDIN_ROOT = Path(__file__).with_name("_sgl_kernel_standin")

#: SGLang server arguments for its CPU engine, used unless given: the attention
#: backend written in plain torch, no CUDA graphs, a KV pool sized in tokens (not
#: as a share of the machine's memory), and a scheduler that sleeps when idle
#: (otherwise it busy-polls a core at 100%).
CPU_DEFAULTS: Mapping[str, object] = MappingProxyType(
    {
        "attention_backend": "torch_native",
        "disable_cuda_graph": True,
        "max_total_tokens": 16384,
        "sleep_on_idle": True,
    }
)


def with_cpu_defaults(server_args: Mapping[str, Any]) -> dict[str, Any]:
    """``server_args`` with ``CPU_DEFAULTS`` under it: a given argument always wins."""
    return {**CPU_DEFAULTS, **server_args}


def prepare_cpu_engine() -> None:
    """Make the next import of SGLang take its CPU engine; idempotent.

    Raises ``RuntimeError`` if SGLang was already imported without it: its
    choice is cached by then, and the engine would fail later and less clearly.
    """
    os.environ[CPU_ENGINE_ENV] = "1"
    common = sys.modules.get("sglang.srt.utils.common")
    if common is not None and not common.is_cpu():
        raise RuntimeError(
            f"SGLang was imported before its CPU engine was asked for, so it took its GPU "
            f"code paths: set {CPU_ENGINE_ENV}=1 before importing sglang, or make the "
            f"SGLangEngine(device='cpu') (or parse trio-sglang's arguments) first"
        )
    if _real_kernels_importable():
        return
    # First on the path: what it can shadow is an sgl_kernel that does not load here.
    root = str(_STANDIN_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)
    # SGLang's scheduler and detokenizer are processes of their own.
    inherited = os.environ.get("PYTHONPATH", "")
    if root not in inherited.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, inherited) if p)


#: The longest a check that an installed ``sgl_kernel`` loads may take (it loads torch).
_IMPORT_CHECK_TIMEOUT = 120.0


def _real_kernels_importable() -> bool:
    """Whether an ``sgl_kernel`` other than the stand-in can be imported here.

    One that is installed is tried in a process of its own: its import loads
    compiled libraries (a CUDA build fails to, without a GPU), and a failed
    one must leave nothing behind in this process.
    """
    loaded = sys.modules.get("sgl_kernel")
    if loaded is not None:
        return not getattr(loaded, "TRIO_SGLANG_STANDIN", False)
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None or _STANDIN_ROOT in Path(spec.origin).parents:
        return False
    try:
        tried = subprocess.run(
            [sys.executable, "-c", "import sgl_kernel"],
            capture_output=True,
            timeout=_IMPORT_CHECK_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False
    return tried.returncode == 0
