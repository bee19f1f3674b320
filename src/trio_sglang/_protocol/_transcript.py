"""The plain transcript: the SimEngine's chat template, and the server's for an engine with none.

One line per message, ``role: text`` (a content made of text parts is their
text, joined), then ``assistant:`` for the answer to follow. With
``continue_final_message`` and a last message that is the assistant's, that
message is left open instead: the answer goes on from its text. It is no
model's template; it keeps a prompt readable where the engine brings none
(the SimEngine models SGLang's tokenizer manager, not a model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["plain_transcript"]


def plain_transcript(
    messages: Sequence[Mapping[str, Any]], *, continue_final_message: bool = False
) -> str:
    """The transcript of checked messages (a role, text content), ready for the answer."""
    lines = [f"{message['role']}: {_text(message['content'])}" for message in messages]
    if not (continue_final_message and messages and messages[-1]["role"] == "assistant"):
        lines.append("assistant:")
    return "\n".join(lines)


def _text(content: str | Sequence[Mapping[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)
