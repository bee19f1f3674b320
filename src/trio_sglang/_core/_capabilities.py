"""The worker's versioned capability metadata, derived from what the engine detected."""

from __future__ import annotations

from typing import Any

from .._engine import EngineFeatures
from .._version import __version__

__all__ = ["SCHEMA_VERSION", "build_capabilities"]

#: Bumped when a key changes meaning or disappears; new keys do not bump it.
SCHEMA_VERSION = 1


def build_capabilities(features: EngineFeatures) -> dict[str, Any]:
    """Capabilities as plain JSON-able data.

    Feature keys carry a ``_vN`` suffix: a consumer that knows ``x_v1`` can
    rely on its meaning forever; a changed meaning gets ``x_v2``. Keys that
    depend on the engine are true only when the engine reported the runtime
    feature they rest on.
    """
    registry = features.request_registry
    dispatch = features.dispatch_timestamp
    release = features.release_on_close
    semantics = features.sglang_semantics
    role = features.role
    return {
        "schema_version": SCHEMA_VERSION,
        "package": {"name": "trio-sglang", "version": __version__},
        "engine": {
            "kind": features.kind,
            "sglang_version": features.sglang_version,
            "disaggregation_mode": features.disaggregation_mode,
            # How this SGLang build registers, dispatches and releases requests,
            # as detected at start (None for an engine that is not SGLang).
            "sglang_semantics": None if semantics is None else dict(semantics),
        },
        # aggregated, prefill or decode (prefill/decode disaggregation).
        "role": role,
        "features": {
            # Properties of the lifecycle itself, whatever the engine.
            "stream_closes_at_cancel_v1": True,
            "early_exit_aborts_v1": True,
            "bounded_detached_cleanup_v1": True,
            "public_ids_only_v1": True,
            # An abort is sent only once dispatch has been observed.
            "ordered_abort_v1": registry and dispatch,
            # A cancel before the first output never leaves work at the
            # engine: an undispatched request is released, a dispatched one
            # aborted after its dispatch.
            "cancel_before_first_output_v1": registry and dispatch and release,
            # n > 1 and native batches stop every child, including children
            # the caller never saw (see "cancellation" for how).
            "parallel_sampling_cancel_v1": True,
            "native_batch_cancel_v1": True,
            "batch_parallel_sampling_v1": features.batch_parallel_sampling,
            # A prefill worker stops a cancelled prefill in any queue
            # (bootstrap, waiting, prefilling, transferring): it has the
            # ordered abort, which needs the registry and the dispatch mark.
            "disagg_prefill_cancel_anytime_v1": role == "prefill" and registry and dispatch,
        },
        # How each kind of request is stopped; the key's suffix versions the
        # meaning of its value.
        "cancellation": {
            "single_sample_v1": "close_then_ordered_abort",
            "native_batch_v1": "close_then_ordered_abort_per_prompt",
            "parallel_sampling_v1": (
                "close_releases_children" if release else "abort_observed_children_then_close"
            ),
        },
    }
