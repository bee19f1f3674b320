"""SGLang's Mooncake KV transfer on a CPU: the prefill side's plain send path.

A real prefill/decode pair runs on this machine over Mooncake's TCP transport
(``MOONCAKE_PROTOCOL=tcp``, the ``mooncake-transfer-engine-non-cuda`` wheel).
One thing in SGLang 0.5.23 stands in its way: ``MooncakeKVSender`` says it
takes host-tensor page indices, and on that path the prefill scheduler pins
memory and records a ``torch.cuda.Event`` for every KV chunk it sends, which
dies with "Found no NVIDIA driver". Saying it does not makes the scheduler
send the indices as plain lists, the path every other backend takes. Nothing
else changes: the bootstrap, the transfer and every abort are SGLang's.
(Two server flags do the rest, in the pair's tests: the decode server's
``--disaggregation-decode-retraction-backup cpu_tensor``, since the default
backup registers host memory with CUDA, and the prefill server's
``--disable-radix-cache``, since a cached prefix is sent on a CUDA stream.)
"""

from __future__ import annotations

from types import ModuleType

from _patch_on_load import patch_on_load

__all__ = ["install"]

_MODULE = "sglang.srt.disaggregation.mooncake.conn"


def install() -> None:
    """Patch Mooncake's KV sender when its module loads; idempotent."""
    patch_on_load(_MODULE, _plain_indices)


def _plain_indices(module: ModuleType) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False
