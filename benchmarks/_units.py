"""How every benchmark writes a figure: one formatter per unit, so a table's numbers agree.

Each takes ``None`` for a figure the run has not got (not measured, never
stopped, no samples) and says so in the cell instead of failing; what it says
is the formatter's default, which a table may replace (``none=``).
"""

from __future__ import annotations

__all__ = ["cores", "count", "mib", "ms", "ms_of_s", "ratio", "seconds", "sig3", "times", "us"]

_MIB = float(2**20)


def ms(value: float | None, none: str = "never") -> str:
    """Milliseconds, without the unit: two decimals below 100, whole ms above (the digits
    that carry signal). ``None``: a request that was never stopped."""
    if value is None:
        return none
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


def ms_of_s(value: float | None) -> str:
    """Seconds, written in ms with the unit: what a user waited, from a figure kept in s."""
    return "-" if value is None else f"{1e3 * value:.2f} ms"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def sig3(value: float | None) -> str:
    """Three significant digits (sim seconds, whose range spans orders of magnitude)."""
    if value is None:
        return "never"
    return "0" if value == 0 else f"{value:.3g}"


def us(value: float | None) -> str:
    """Microseconds, without the unit (a table's header names it)."""
    return "-" if value is None else f"{value:.1f}"


def mib(value: float | None) -> str:
    """Bytes, in MiB; "n/a" where the server exports no memory figure."""
    return "n/a" if value is None else f"{value / _MIB:.1f} MiB"


def cores(value: float | None) -> str:
    """CPU seconds over wall seconds; "n/a" where the server exports no CPU figure."""
    return "n/a" if value is None else f"{value:.2f} cores"


def count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def ratio(value: float | None, base: float | None) -> float | None:
    """``value`` over ``base``; None when either is missing or ``base`` is not above 0."""
    if value is None or base is None or base <= 0:
        return None
    return value / base


def times(value: float | None, none: str = "-") -> str:
    """A ratio, as a multiple."""
    return none if value is None else f"{value:.2f}x"
