"""What every benchmark's report is, beside its own figures: targets, tables, text, files.

A report says what one run measured three ways, and the three must agree:
the text on stdout, its section of ``summary.md`` and its JSON. So a table is
written once, as columns (a header and how to read each cell off a row), and
rendered both as text and as Markdown; the targets, judged by the rule of
``_verdict.py``, make the verdict lines, the Markdown verdicts and the JSON's
``targets``; and the files land where ``_output.py`` says.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from _output import append_summary, machine, markdown_table, table, write_json
from _verdict import Target

__all__ = ["BenchReport", "Column", "SummaryReport", "columns_table"]

R = TypeVar("R")
#: A table's column: its header, and its cell in a row.
Column = tuple[str, Callable[[R], str]]


def columns_table(
    columns: Sequence[Column[R]], rows: Iterable[R | str], *, markdown: bool = False, **text: Any
) -> list[str]:
    """``rows`` under ``columns``, as text (``table``'s options in ``text``) or Markdown.

    A ``str`` in ``rows`` is a heading line across the text table; Markdown, which
    has none, leaves it out."""
    header = [head for head, _ in columns]
    cells = [row if isinstance(row, str) else [cell(row) for _, cell in columns] for row in rows]
    if markdown:
        return markdown_table(header, [row for row in cells if not isinstance(row, str)])
    return table(header, cells, **text)


class BenchReport(ABC):
    """One run's report: what it measured as text, its targets, its JSON and its files."""

    __slots__ = ()

    @abstractmethod
    def targets(self) -> list[Target]:
        """The run's targets, judged on its machine (``Target.judged_on``)."""

    @abstractmethod
    def lines(self) -> list[str]:
        """The text on stdout, a line at a time."""

    @abstractmethod
    def to_json(self, machine: dict[str, Any]) -> dict[str, Any]: ...

    def format(self) -> str:
        return "\n".join(self.lines())

    @property
    def passed(self) -> bool:
        return all(target.met for target in self.targets())

    def targets_json(self) -> list[dict[str, Any]]:
        return [target.to_json() for target in self.targets()]

    def verdict_lines(self, heading: str, notable: Sequence[str] = ()) -> list[str]:
        """The targets under ``heading``, then PASS or FAIL; the server log's last
        ``notable`` lines above that, for the FAIL a person then has to explain."""
        lines = [heading, *(target.line() for target in self.targets()), ""]
        if notable:
            lines += ["server log, last notable lines:", *notable[-10:], ""]
        return [*lines, f"verdict: {'PASS' if self.passed else 'FAIL'}"]

    def targets_markdown(self) -> list[str]:
        return markdown_table(
            ["verdict", "what", "measured", "target"],
            [
                [target.verdict, target.what, target.measured, target.target]
                for target in self.targets()
            ],
        )


class SummaryReport(BenchReport):
    """A report with a section of the run folder's ``summary.md`` beside its JSON."""

    __slots__ = ()

    @abstractmethod
    def markdown(self) -> str: ...

    def save(self, folder: Path, json_path: Path | None, name: str) -> list[Path]:
        """The JSON (at ``json_path``, or ``name`` in ``folder``) and the report's section of
        the folder's ``summary.md``, after the sections other benchmarks put there."""
        path = write_json(json_path or folder / name, self.to_json(machine()))
        return [path, append_summary(folder, self.markdown())]
