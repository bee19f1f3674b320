"""Mutation testing of the lifecycle core: mutmut, survivors by module, a verdict.

Run by ``nox -s mutants`` (docs/mutants.md). What is mutated and the oracle
(the fast MockClock tests) are ``[tool.mutmut]`` in pyproject.toml. Every run
starts afresh in ``mutants/``: a result cached from before a test was added
would be a survivor that is not one. The exit status is 1 if a mutant of the
core survived and docs/mutants.md does not list it as equivalent.

Two changes to what mutmut 3.8.1 mutates (patches of its internals: hence
the exact pin). It leaves every decorated function alone, which here would
leave out ``open_worker``, the lifecycle's top, and the worker's properties; the
two decorators in ``WRAPPING`` only wrap a function (they neither register
nor cache it), so its undecorated copies stand in for it exactly, and it
mutates them. And it leaves the words of a message alone (a string literal
with a space in it): what a person reads is no part of the contract, while a
key, a name or a fault kind (no space) still is.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from mutmut.__main__ import cli
from mutmut.configuration import config
from mutmut.mutation import file_mutation, mutators
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files
from mutmut.utils.format_utils import orig_function_and_class_names_from_key

#: ``--quick``, CI's subset: the code that carries a cancel from the caller's stream to
#: the engine (the request's lifecycle, its block, the worker's shutdown, the ordered
#: abort, its confirmation and the cleanup's owner), not constructors, nor the
#: request's way in (``generate``).
QUICK = (
    "trio_sglang._core._lifecycle.xǁResponseStreamǁ[!_]*",
    "trio_sglang._core._lifecycle.xǁResponseStreamǁ_[!_]*",
    "trio_sglang._core._lifecycle.xǁResponseStreamǁ__a*",
    "trio_sglang._core._worker.xǁWorkerǁ_[!_]*",
    "trio_sglang._core._worker.xǁWorkerǁend_grace*",
    "trio_sglang._core._cleanup.*",
    "trio_sglang._core._shared.*",
    "trio_sglang._core._cleanup_group.*",
    "trio_sglang._core._drain.*",
    "trio_sglang._core._disagg.xǁPrefillLegǁend*",
)
EQUIVALENTS = Path("docs/mutants.md")
#: Decorators that wrap a function and nothing else (see the module's docstring).
WRAPPING = frozenset({"asynccontextmanager", "property"})
KILLED = frozenset({"killed", "timeout", "caught by type check"})
SURVIVED = frozenset({"survived", "no tests"})


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    module: str
    function: str
    status: str
    #: The source lines the mutant changes, and what it makes of them (stripped).
    before: str
    after: str

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What docs/mutants.md lists it by: stable while its line is (mutmut's number is not)."""
        return (self.module, self.function, self.before, self.after)


# -- mutmut, made to mutate wrapped functions ----------------------------------------------


def _only_wrapped(function: cst.FunctionDef) -> bool:
    decorators = [d.decorator for d in function.decorators]
    names = [d.value for d in decorators if isinstance(d, cst.Name)]
    return bool(decorators) and len(names) == len(decorators) and WRAPPING.issuperset(names)


def mutate_wrapped_functions() -> None:
    """Mutate a function under ``WRAPPING`` decorators: its copies go undecorated, the
    trampoline that picks one keeps the decorators."""
    skip = file_mutation.MutationVisitor._skip_node_and_children
    arrange = file_mutation.function_trampoline_arrangement

    def skip_unless_wrapped(self: file_mutation.MutationVisitor, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.FunctionDef) and _only_wrapped(node):
            node = node.with_changes(decorators=())
        return skip(self, node)

    def arrange_wrapped(
        function: cst.FunctionDef,
        mutants: Iterable[file_mutation.Mutation],
        class_name: str | None,
    ) -> tuple[
        Sequence[file_mutation.MODULE_STATEMENT],
        Sequence[file_mutation.MODULE_STATEMENT],
        Sequence[file_mutation.MODULE_STATEMENT],
        Sequence[str],
    ]:
        if not _only_wrapped(function):
            return arrange(function, mutants, class_name)
        dicts, nodes, assignments, names = arrange(
            function.with_changes(decorators=()), mutants, class_name
        )
        trampoline = nodes[0]
        assert isinstance(trampoline, cst.FunctionDef)
        decorated = trampoline.with_changes(
            decorators=[*function.decorators, *trampoline.decorators]
        )
        return dicts, [decorated, *nodes[1:]], assignments, names

    file_mutation.MutationVisitor._skip_node_and_children = skip_unless_wrapped  # type: ignore[method-assign]
    file_mutation.function_trampoline_arrangement = arrange_wrapped


def leave_words_alone() -> None:
    """Mutate no string literal with a space in it (the words of a message)."""
    mutate_string = mutators.operator_string

    def mutate_unless_words(node: cst.BaseString) -> Iterable[cst.BaseString]:
        if isinstance(node, cst.SimpleString) and " " in node.value:
            return ()
        return mutate_string(node)

    operators = mutators.mutation_operators
    assert isinstance(operators, list)  # the list file_mutation reads, changed in place
    (at,) = [i for i, (_, operator) in enumerate(operators) if operator is mutate_string]
    operators[at] = (cst.BaseString, mutate_unless_words)


def check_test_ids() -> None:
    """Exit if pytest cannot take an oracle test's id back as an argument.

    mutmut runs each mutant's tests by id, and a run that pytest refuses
    (exit 4) counts as a kill: every mutant those tests cover would pass as
    killed. In a subprocess, so that this process never imports the package
    before mutmut has put its mutants first on the path.
    """
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only"]
    listed = subprocess.run(
        [*pytest, *config().pytest_add_cli_args_test_selection],
        capture_output=True,
        text=True,
        check=True,
    )
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    again = subprocess.run([*pytest, *ids], capture_output=True, text=True, check=False)
    if again.returncode != 0:
        sys.exit(f"pytest cannot run the oracle's tests by id:\n{again.stdout}{again.stderr}")


# -- the results -----------------------------------------------------------------------------


def read_mutants() -> tuple[list[Mutant], bool]:
    """Every mutant mutmut ran (or found no test for), with the line it changes; and
    whether that is every mutant (the run was not of a subset)."""
    mutants = []
    every = True
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        for name, exit_code in data.exit_code_by_key.items():
            status = status_by_exit_code[exit_code]
            if status == "not checked":
                every = False  # outside this run's subset
                continue
            function, class_name = orig_function_and_class_names_from_key(name)
            before, after = changed_lines(get_diff_for_mutant(name, path=path))
            qualified = f"{class_name}.{function}" if class_name else function
            mutants.append(Mutant(name, path.name, qualified, status, before, after))
    return mutants, every


def changed_lines(diff: str) -> tuple[str, str]:
    lines = diff.splitlines()[2:]  # past the ---/+++ header
    removed = [line[1:].strip() for line in lines if line.startswith("-")]
    added = [line[1:].strip() for line in lines if line.startswith("+")]
    return " / ".join(removed), " / ".join(added)


def listed_equivalents(page: Path) -> dict[tuple[str, str, str, str], str]:
    """The table under "## Equivalent mutants": module, function, line, mutant, reason."""
    rows: dict[tuple[str, str, str, str], str] = {}
    section = page.read_text().split("## Equivalent mutants", 1)[-1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != 5 or not cells[0].startswith("`"):
            continue  # not a row, or the header or its rule
        module, function, before, after = (_code(cell) for cell in cells[:4])
        rows[(module, function, before, after)] = cells[4]
    return rows


def _code(cell: str) -> str:
    """A cell's code span as the source has it."""
    return cell.replace("\\|", "|").removeprefix("``").removesuffix("``").strip("`").strip()


def report(
    mutants: list[Mutant], equivalents: dict[tuple[str, str, str, str], str], *, full: bool
) -> int:
    """Scores by module, then each unlisted survivor; how many there are (with the unsure).

    After a full run, also the listed mutants that no longer survive (or exist).
    """
    modules = sorted({m.module for m in mutants})
    survivors = [m for m in mutants if m.status in SURVIVED]
    unlisted = [m for m in survivors if m.key not in equivalents]
    unsure = [m for m in mutants if m.status not in KILLED | SURVIVED]
    print("\nmutation score of the lifecycle core (killed / mutants):")
    for module in modules:
        mine = [m for m in mutants if m.module == module]
        killed = sum(m.status in KILLED for m in mine)
        listed = sum(m.module == module and m.key in equivalents for m in survivors)
        doubts = sum(m.module == module for m in unsure)
        line = f"  {module:20} {killed / len(mine):7.1%}  {killed:4}/{len(mine):<4}"
        print(line + f"  {listed} equivalent" + (f", {doubts} unsure" if doubts else ""))
    for title, group in (("survivors not listed as equivalent", unlisted), ("unsure", unsure)):
        if not group:
            continue
        print(f"\n{title} ({len(group)}), by module:")
        for module in modules:
            for m in (m for m in group if m.module == module):
                print(f"  {module} {m.function} [{m.status}] {m.name.rpartition('.')[2]}")
                print(f"      - {m.before}\n      + {m.after}")
    if unlisted:
        print(f"\nkill each with a test, or list it in {EQUIVALENTS} with a one-line reason")
        print("(its module, function, line and mutant, as above)")
    stale = sorted(set(equivalents) - {m.key for m in survivors}) if full else []
    if stale:
        print(f"\nlisted in {EQUIVALENTS} but not among the survivors (take them out):")
        for module, function, before, after in stale:
            print(f"  {module} {function}\n      - {before}\n      + {after}")
    return len(unlisted) + len(unsure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI's subset (QUICK)")
    parser.add_argument("--max-children", type=int, default=2, help="mutants run at once")
    parser.add_argument(
        "--report", action="store_true", help="no run: the report of the last one, afresh"
    )
    parser.add_argument("names", nargs="*", help="mutant names or globs, as mutmut takes them")
    args = parser.parse_args(argv)
    names = [*args.names, *(QUICK if args.quick else ())]

    if not args.report:
        check_test_ids()
        shutil.rmtree("mutants", ignore_errors=True)
        mutate_wrapped_functions()
        leave_words_alone()
        start = time.monotonic()
        try:
            run = ["run", "--max-children", str(args.max_children), *names]
            cli.main(run, standalone_mode=False)
        except SystemExit as exc:
            if exc.code:
                return int(exc.code) if isinstance(exc.code, int) else 1
        minutes, seconds = divmod(round(time.monotonic() - start), 60)
        print(f"\nmutmut ran for {minutes}m{seconds:02}s")
    mutants, every = read_mutants()
    print(f"{len(mutants)} mutants")
    failures = report(mutants, listed_equivalents(EQUIVALENTS), full=every)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
