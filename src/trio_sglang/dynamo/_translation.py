"""What one of Dynamo's input modes is to the bridge: the engine's request in, Dynamo's chunks out.

A worker registered with ``ModelInput.Tokens`` gets the frontend's
preprocessed requests and yields token chunks (``_mapping.py``); one
registered with ``ModelInput.Text`` gets the client's OpenAI body and yields
OpenAI chunks (``_text.py``). The bridge serves both alike, with the same
cancellation: it runs a ``Translation``'s body through ``Worker.generate``,
hands each output's chunk over, then the closing ones, and merges a backlog
with the mode's ``merge``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._request._parse import OutputMode
from ._exchange import Merge

__all__ = ["InputMode", "Translation"]


@dataclass(frozen=True, slots=True)
class Translation:
    """One request as the engine takes it, and how its outputs become Dynamo's chunks."""

    #: The request for ``Worker.generate``.
    body: dict[str, Any]
    #: The worker's output mode for it.
    output: OutputMode
    #: Dynamo's chunk for one of the worker's, or None for one with nothing in it.
    chunk: Callable[[dict[str, Any]], dict[str, Any] | None]
    #: The chunks after the last output (the usage an OpenAI request asked for).
    closing: Callable[[], list[dict[str, Any]]]
    #: A field of ``body`` -> the client's name for it, for ``Worker.prepare``'s refusals.
    names: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class InputMode:
    """How a worker registered with one ``ModelInput`` reads its requests and merges its chunks."""

    #: A request's ``Translation``; ``InvalidRequest`` names what cannot be served.
    translate: Callable[[Mapping[str, Any]], Translation]
    merge: Merge
