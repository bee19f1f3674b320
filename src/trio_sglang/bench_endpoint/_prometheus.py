"""The few series bench-endpoint reads from a Prometheus text page, and nothing else.

A vLLM or SGLang page is 100 to 300 KB of histograms; parsing all of it
(``prometheus_client``'s parser builds every family) would take longer than
the 10 ms between two samples. So this reads only the lines of the wanted
metric names: a prefix test per line, then one regular expression on the few
lines that pass.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Series", "metric_names", "parse_series"]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_SAMPLE = re.compile(rf"({_NAME})(?:\{{(.*)\}})?\s+(\S+)")
_SELECTOR = re.compile(rf"\s*({_NAME})\s*(?:\{{(.*)\}})?\s*")
_UNESCAPE = re.compile(r"\\(.)")


def _labels(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    position = 0
    while position < len(text):
        match = _LABEL.match(text, position)
        if match is None:
            raise ValueError(f"not a label list: {{{text}}}")
        value = _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), match.group(2))
        found[match.group(1)] = value
        position = match.end()
    return found


def _value(text: str) -> float:
    value = float(text)  # accepts NaN, +Inf, -Inf as Prometheus writes them
    return 0.0 if math.isnan(value) else value


@dataclass(frozen=True, slots=True)
class Series:
    """One metric, the samples of it that count, summed.

    ``labels`` (pairs, sorted) must match exactly. A sample that carries one of the
    ``breakdowns`` labels with a value is a share of a total the page also
    holds, so it is left out: SGLang writes a queue's total without a
    ``priority`` and, with priority scheduling, each priority's share under
    ``priority="N"`` too.
    """

    name: str
    labels: tuple[tuple[str, str], ...] = ()
    breakdowns: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Series:
        """``name`` or ``name{label="value",...}``, as PromQL writes a selector."""
        match = _SELECTOR.fullmatch(text)
        if match is None:
            raise ValueError(f"not a metric name or selector: {text!r}")
        return cls(match.group(1), tuple(sorted(_labels(match.group(2) or "").items())))

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        inside = ",".join(f'{key}="{value}"' for key, value in self.labels)
        return f"{self.name}{{{inside}}}"

    def counts(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.labels) and not any(
            labels.get(label) for label in self.breakdowns
        )


def parse_series(text: str, wanted: Iterable[Series]) -> dict[Series, float | None]:
    """The sum of each wanted series on the page; None for one with no sample on it."""
    wanted = tuple(wanted)
    names = tuple({series.name for series in wanted})
    sums: dict[Series, float | None] = dict.fromkeys(wanted)
    for line in text.splitlines():
        if not line.startswith(names):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels = match.group(1), _labels(match.group(2) or "")
        for series in wanted:
            if series.name == name and series.counts(labels):
                sums[series] = (sums[series] or 0.0) + _value(match.group(3))
    return sums


def metric_names(text: str) -> set[str]:
    """Every sample name on the page (``name_total`` for a counter, as the page writes it)."""
    found = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            match = _SAMPLE.match(line)
            if match is not None:
                found.add(match.group(1))
    return found
