"""Internal engine rids.

SGLang's scheduler aborts every request whose rid *starts with* the aborted
rid, so an internal rid must never be a prefix of another one: all of them
have the same length (32 hex digits), and two different strings of the same
length are never prefixes of each other. The caller's own rid never reaches
the engine, so a caller cannot create a collision either.
"""

from __future__ import annotations

import uuid

__all__ = ["RID_LENGTH", "mint_rid"]

RID_LENGTH = 32


def mint_rid() -> str:
    return uuid.uuid4().hex
