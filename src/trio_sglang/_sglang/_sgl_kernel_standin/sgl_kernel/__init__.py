"""trio-sglang's import-only stand-in for ``sgl_kernel``, SGLang's compiled kernels.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports eight names from
``sgl_kernel`` when its modules load, and no package index ships a CPU build
of it. On a CPU without AMX every layer takes its plain-torch path and none of
the eight is called, so this package defines them for the import alone. It is
put on the path only for ``device="cpu"`` and only when no real ``sgl_kernel``
can be imported (``trio_sglang._sglang._cpu``); each name fails loudly if a
code path ever does call it, instead of computing anything wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

#: Marks this module as the stand-in (what ``trio_sglang._sglang._cpu`` checks for).
TRIO_SGLANG_STANDIN = True


class StandInKernelCalled(RuntimeError):
    """SGLang called a compiled CPU kernel that this stand-in only names."""


def _kernel(name: str) -> Callable[..., NoReturn]:
    def call(*args: object, **kwargs: object) -> NoReturn:
        raise StandInKernelCalled(
            f"SGLang called sgl_kernel.{name}, a compiled CPU kernel. trio-sglang's "
            "stand-in only lets SGLang's CPU engine import: this model or these server "
            "arguments need a real CPU build of sgl_kernel (or a GPU)"
        )

    call.__name__ = call.__qualname__ = name
    return call


# The eight names SGLang 0.5.23's CPU engine imports at module load.
assign_draft_cache_locs_contiguous_cpu = _kernel("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _kernel("assign_extend_cache_locs_cpu")
assign_req_to_token_pool_cpu = _kernel("assign_req_to_token_pool_cpu")
build_tree_kernel_efficient_cpu = _kernel("build_tree_kernel_efficient_cpu")
copy_all_layer_kv_cache_cpu = _kernel("copy_all_layer_kv_cache_cpu")
fill_accept_out_cache_loc_cpu = _kernel("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _kernel("fill_bonus_tokens_cpu")
verify_tree_greedy_cpu = _kernel("verify_tree_greedy_cpu")

__all__ = [
    "TRIO_SGLANG_STANDIN",
    "StandInKernelCalled",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]
