"""The bootstrap fields of a disaggregated request, checked against the worker's role.

A prefill worker's request must name its ``bootstrap_room``, and a decode
worker's must also say where the prefill side's bootstrap server is; an
aggregated worker takes them as SGLang does, checked but unused. A decode
worker whose request comes without them runs its prefill leg itself
(``_core/_disagg.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._engine import Role
from .._errors import InvalidRequest

__all__ = ["BOOTSTRAP_FIELDS", "check_bootstrap"]

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def _is_room(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _is_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


#: Each bootstrap field: how to tell a good value, and what it must be.
_BOOTSTRAP_CHECKS = {
    "bootstrap_room": (_is_room, "an int in [0, 2**63)"),
    "bootstrap_host": (lambda value: isinstance(value, str), "a string"),
    "bootstrap_port": (_is_port, "an int in [1, 65535]"),
}


def check_bootstrap(body: Mapping[str, Any], batch_size: int | None, role: Role) -> None:
    """The bootstrap fields as SGLang reads them: one value, or a list with one per prompt."""
    for name, (valid, what) in _BOOTSTRAP_CHECKS.items():
        value = body.get(name)
        if value is None:
            continue
        per_prompt = isinstance(value, list) and batch_size is not None
        values = value if per_prompt else [value]
        if per_prompt and len(values) != batch_size:
            raise InvalidRequest(f"{name} must have one value per prompt of a native batch")
        for one in values:
            if not valid(one):
                who = (
                    f"a {role} worker needs {name}," if role != "aggregated" else f"{name} must be"
                )
                raise InvalidRequest(f"{who} {what}, got {type(one).__name__}")
    if role != "aggregated" and body.get("bootstrap_room") is None:
        raise InvalidRequest(
            f"a {role} worker needs bootstrap_room, {_BOOTSTRAP_CHECKS['bootstrap_room'][1]}"
        )
    if role == "decode" and body.get("bootstrap_host") is None:
        # SGLang's decode side fails the handshake at once without it.
        raise InvalidRequest(
            "a decode worker needs bootstrap_host with bootstrap_room: where the prefill "
            "side's bootstrap server is"
        )
