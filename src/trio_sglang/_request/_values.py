"""What a value must be: the predicates the request checks share, and the settings' one range check.

JSON has one number type; Python's ``json`` makes ints and floats of it, and
``True`` is an ``int`` to Python. SGLang's own checks (msgspec, pydantic)
refuse a bool where a number goes, so these do too, and so does
``check_at_least``, the range check of every settings class (``AbortPolicy``,
``ServerLimits``, the SimEngine's timings, ``Faults``), so that each says a
bad value the same way.
"""

from __future__ import annotations

import math
import reprlib
from typing import TypeGuard

__all__ = [
    "MAX_INT",
    "check_at_least",
    "is_int",
    "is_number",
    "is_one_of",
    "is_token_list",
    "is_unicode",
    "shown",
]

#: The largest token id or token count SGLang's int32 fields hold.
MAX_INT = 2**31 - 1


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """A finite number that survives SGLang's float conversion (10**400 does not)."""
    if not (is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def check_at_least(
    name: str,
    value: object,
    least: int,
    *,
    integer: bool = False,
    above: bool = False,
    finite: bool = False,
) -> None:
    """Refuse ``value`` (``ValueError``, naming ``name``) unless it is at least ``least``.

    ``integer``: an int (not a bool); otherwise a number of seconds, not NaN,
    and ``finite`` if asked. ``above``: strictly above ``least``.
    """
    if integer:
        kind = "an int"
        ok = is_int(value) and (value > least if above else value >= least)
    else:
        kind = "a finite number of seconds" if finite else "a number of seconds"
        ok = (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and not math.isnan(value)
            and (math.isfinite(value) or not finite)
            and (value > least if above else value >= least)
        )
    if not ok:
        raise ValueError(f"{name} must be {kind} {'>' if above else '>='} {least}, got {value!r}")


def is_one_of(value: object, options: tuple[object, ...]) -> bool:
    """``value in options``, but a bool equals no number (``True == 1`` to Python)."""
    return any(value == option and type(value) is type(option) for option in options)


def is_token_list(value: object) -> bool:
    """A non-empty list of token ids (ints in [0, 2**31 - 1])."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(is_int(t) and 0 <= t <= MAX_INT for t in value)
    )


def is_unicode(text: str) -> bool:
    """Whether a tokenizer can encode ``text``.

    JSON lets a string escape half a surrogate pair (``"\\ud800"``), which
    decodes to a Python ``str`` that UTF-8 cannot encode; the engine would
    fail on it while tokenizing, after the rid was registered.
    """
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def shown(value: object) -> str:
    """A value for an error message.

    ``reprlib``: bounded in depth and length, so neither a value nested close
    to the JSON parser's limit (``RecursionError``) nor a megabyte string gets in.
    """
    return reprlib.repr(value)
