"""Where a worker registers in Dynamo, and how its runtime reaches the others.

The planes come from Dynamo's own environment variables, with Dynamo's own
defaults, so that one environment configures the frontend and every worker
alike: ``DYN_DISCOVERY_BACKEND`` (``etcd``; ``file`` with ``DYN_FILE_KV`` for
one machine), ``DYN_REQUEST_PLANE`` (``tcp``), ``DYN_RESPONSE_PLANE``
(``tcp``) and ``DYN_EVENT_PLANE`` (the runtime's choice when unset).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

__all__ = ["MODEL_INPUTS", "SIM_MODEL_PATH", "DynamoEndpoint", "ModelInputKind", "RuntimePlanes"]

#: The SimEngine's tokenizer: its 64 words, for Dynamo's frontend to tokenize with.
SIM_MODEL_PATH = Path(__file__).with_name("sim_model")

#: Dynamo's ``ModelInput``: ``tokens``, the frontend tokenizes; ``text``, the worker does.
ModelInputKind = Literal["tokens", "text"]
MODEL_INPUTS: tuple[ModelInputKind, ...] = get_args(ModelInputKind)

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_CHOICES = {
    "DYN_DISCOVERY_BACKEND": ("etcd", ("kubernetes", "etcd", "file", "mem")),
    "DYN_REQUEST_PLANE": ("tcp", ("tcp", "nats")),
    "DYN_RESPONSE_PLANE": ("tcp", ("tcp", "quic")),
    "DYN_EVENT_PLANE": (None, ("nats", "zmq")),
}


@dataclass(frozen=True, slots=True)
class DynamoEndpoint:
    """The endpoint a worker serves (``namespace.component.endpoint``) and the model on it."""

    model_name: str
    #: The model's folder. With ``tokens`` Dynamo's frontend reads its tokenizer and chat
    #: template there; with ``text`` it is only named in the model's card.
    model_path: Path = SIM_MODEL_PATH
    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"
    #: ``tokens``: the frontend tokenizes, renders chat and detokenizes, and its KV router
    #: works. ``text``: the worker gets the client's OpenAI body, and needs no tokenizer there.
    model_input: ModelInputKind = "tokens"

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("the model needs a name")
        for part in ("namespace", "component", "endpoint"):
            value = getattr(self, part)
            if not isinstance(value, str) or not _NAME.fullmatch(value):
                raise ValueError(f"{part} {value!r}: letters, digits, '-' and '_' only")
        if self.model_input not in MODEL_INPUTS:
            raise ValueError(f"model_input {self.model_input!r}: one of {', '.join(MODEL_INPUTS)}")
        if self.model_input == "tokens" and not Path(self.model_path, "tokenizer.json").is_file():
            raise ValueError(f"{self.model_path}: no tokenizer.json (the frontend tokenizes)")

    @property
    def path(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"


@dataclass(frozen=True, slots=True)
class RuntimePlanes:
    """The runtime's discovery backend and transports."""

    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    response_plane: str = "tcp"
    event_plane: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RuntimePlanes:
        """From Dynamo's environment variables; a value Dynamo would refuse is refused here."""
        values: dict[str, str | None] = {}
        for name, (default, allowed) in _CHOICES.items():
            value = values[name] = environ.get(name) or default
            if value is not None and value not in allowed:
                raise ValueError(f"{name}={value!r}: one of {', '.join(allowed)}")
        return cls(
            discovery_backend=str(values["DYN_DISCOVERY_BACKEND"]),
            request_plane=str(values["DYN_REQUEST_PLANE"]),
            response_plane=str(values["DYN_RESPONSE_PLANE"]),
            event_plane=values["DYN_EVENT_PLANE"],
        )
