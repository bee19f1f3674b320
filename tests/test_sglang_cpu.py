"""What ``device="cpu"`` sets up before SGLang is imported, without SGLang.

The environment variable, the import-only ``sgl_kernel`` stand-in (put first on
the path only when no working ``sgl_kernel`` imports, a broken one shadowed,
a working one never), its loud failure if a kernel is ever called, and the
CPU defaults under the arguments given. The whole engine on the CPU is
``tests/test_real_engine*.py``'s (``nox -s real-engine``).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_sglang._sglang import _cpu as _sglang_cpu
from trio_sglang._sglang._cpu import CPU_ENGINE_ENV, prepare_cpu_engine, with_cpu_defaults

STANDIN = str(Path(_sglang_cpu.__file__).with_name("_sgl_kernel_standin"))


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No sgl_kernel anywhere, SGLang not imported; the path and environment restored after."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != STANDIN])
    monkeypatch.setenv(CPU_ENGINE_ENV, "0")  # recorded, so that the "1" set here is undone
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("sgl_kernel", "sglang.srt.utils.common"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield tmp_path
    sys.modules.pop("sgl_kernel", None)
    importlib.invalidate_caches()


def fake_kernels(folder: Path, body: str) -> None:
    (folder / "sgl_kernel").mkdir()
    (folder / "sgl_kernel" / "__init__.py").write_text(body)
    importlib.invalidate_caches()


def test_without_sgl_kernel_the_stand_in_goes_first_here_and_in_sglangs_processes(
    clean: Path,
) -> None:
    prepare_cpu_engine()
    assert os.environ[CPU_ENGINE_ENV] == "1"  # even over a "0"
    assert sys.path[0] == STANDIN
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [STANDIN, str(clean)]
    kernels = importlib.import_module("sgl_kernel")
    assert kernels.TRIO_SGLANG_STANDIN is True
    with pytest.raises(kernels.StandInKernelCalled, match="copy_all_layer_kv_cache_cpu"):
        kernels.copy_all_layer_kv_cache_cpu(1, 2)
    prepare_cpu_engine()  # idempotent: once on each path
    assert sys.path.count(STANDIN) == 1
    assert os.environ["PYTHONPATH"].count(STANDIN) == 1


def test_a_working_sgl_kernel_is_never_shadowed(clean: Path) -> None:
    fake_kernels(clean, "REAL = True\n")
    prepare_cpu_engine()
    assert STANDIN not in sys.path
    assert importlib.import_module("sgl_kernel").REAL is True


def test_a_build_that_cannot_load_here_is_shadowed(clean: Path) -> None:
    fake_kernels(clean, "raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    prepare_cpu_engine()
    assert sys.path[0] == STANDIN
    assert importlib.import_module("sgl_kernel").TRIO_SGLANG_STANDIN is True


def test_sglang_imported_without_its_cpu_engine_is_named(
    clean: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = types.ModuleType("sglang.srt.utils.common")
    common.__dict__["is_cpu"] = lambda: False  # it took the GPU paths
    monkeypatch.setitem(sys.modules, "sglang.srt.utils.common", common)
    with pytest.raises(RuntimeError, match="set SGLANG_USE_CPU_ENGINE=1 before importing sglang"):
        prepare_cpu_engine()


def test_the_cpu_defaults_give_way_to_what_is_given() -> None:
    args = with_cpu_defaults({"model_path": "m", "attention_backend": "sdpa"})
    assert args == {
        "model_path": "m",
        "attention_backend": "sdpa",
        "disable_cuda_graph": True,
        "max_total_tokens": 16384,
        "sleep_on_idle": True,
    }
