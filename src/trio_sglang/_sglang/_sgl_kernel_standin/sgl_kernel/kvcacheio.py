"""The host KV-cache transfer kernels SGLang 0.5.10 imports whenever its TokenizerManager loads.

That release's ``mem_cache/memory_pool_host.py`` imports them on every
platform but NPU, XPU and MPS, so without them not even the TokenizerManager
loads on a CPU-only machine; the tokenizer side calls none of them.
"""

from __future__ import annotations

from . import _kernel

transfer_kv_all_layer = _kernel("kvcacheio.transfer_kv_all_layer")
transfer_kv_all_layer_direct_lf_pf = _kernel("kvcacheio.transfer_kv_all_layer_direct_lf_pf")
transfer_kv_all_layer_lf_pf = _kernel("kvcacheio.transfer_kv_all_layer_lf_pf")
transfer_kv_all_layer_lf_ph = _kernel("kvcacheio.transfer_kv_all_layer_lf_ph")
transfer_kv_all_layer_mla = _kernel("kvcacheio.transfer_kv_all_layer_mla")
transfer_kv_all_layer_mla_lf_pf = _kernel("kvcacheio.transfer_kv_all_layer_mla_lf_pf")
transfer_kv_direct = _kernel("kvcacheio.transfer_kv_direct")
transfer_kv_per_layer = _kernel("kvcacheio.transfer_kv_per_layer")
transfer_kv_per_layer_direct_pf_lf = _kernel("kvcacheio.transfer_kv_per_layer_direct_pf_lf")
transfer_kv_per_layer_mla = _kernel("kvcacheio.transfer_kv_per_layer_mla")
transfer_kv_per_layer_mla_pf_lf = _kernel("kvcacheio.transfer_kv_per_layer_mla_pf_lf")
transfer_kv_per_layer_pf_lf = _kernel("kvcacheio.transfer_kv_per_layer_pf_lf")
transfer_kv_per_layer_ph_lf = _kernel("kvcacheio.transfer_kv_per_layer_ph_lf")
