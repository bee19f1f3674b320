"""What the package's layout promises: optional parts stay optional, the simulator stays apart.

``trio-asyncio`` comes only with the ``sglang`` extra, so the package, its
server and its simulator must import without it. The lifecycle and the HTTP
server know the SimEngine only through protocols: neither imports
``trio_sglang.sim`` (lazily or for type checking either), and ``serve``
gets its engine from the CLI's one factory.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import trio_sglang
from _benchmarks import BENCHMARKS
from trio_sglang._cli._engines import EngineOptions, open_engine
from trio_sglang.server import ServerMetrics
from trio_sglang.server._metrics import CountsEvents
from trio_sglang.sim import DisaggregationMode, SimEngine, SimKVRooms

PACKAGE = Path(trio_sglang.__file__).parent

#: What the lifecycle (``_core/``) stands on: the engine protocol, the errors, and
#: SGLang's request as the worker checks it. The simulator is one engine among others.
BENEATH_THE_CORE = (
    "_engine.py",
    "_errors.py",
    *(f"_request/{path.name}" for path in sorted((PACKAGE / "_request").glob("*.py"))),
)
#: The lifecycle's modules, and the modules it stands on.
LIFECYCLE = (
    *sorted((PACKAGE / "_core").glob("*.py")),
    *(PACKAGE / name for name in BENEATH_THE_CORE),
)
#: The most modules the package's root holds: the public API, the engine protocol,
#: the errors and a few leaves shared by the folders; everything else in a folder.
ROOT_MODULES = 12


def test_the_package_imports_without_trio_asyncio() -> None:
    script = textwrap.dedent(
        """
        import sys

        sys.modules["trio_asyncio"] = None  # as if not installed

        import trio_sglang as ts
        import trio_sglang.server

        assert ts.SGLangEngine.__name__ == "SGLangEngine"
        for name in ts.__all__:
            getattr(ts, name)
        # As the guest of a host loop, SGLang runs there: trio-asyncio is not needed.
        ts.SGLangEngine(tokenizer_manager=object(), asyncio_loop=object())
        try:
            ts.SGLangEngine(tokenizer_manager=object())
        except ImportError as exc:
            print(exc)
        else:
            raise AssertionError("SGLangEngine was made without trio-asyncio")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'trio-sglang[asyncio]'" in result.stdout


def test_the_package_root_loads_the_simulator_only_when_asked_for_it() -> None:
    script = textwrap.dedent(
        """
        import sys

        import trio_sglang

        print("trio_sglang.sim" in sys.modules)
        print(trio_sglang.SimEngine.__module__, "SimEngine" in dir(trio_sglang))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "trio_sglang.sim._sim_engine", "True"]
    with pytest.raises(AttributeError, match="has no attribute 'Simengine'"):
        trio_sglang.Simengine  # noqa: B018


def test_the_wheel_holds_the_product_and_not_the_harness(tmp_path: Path) -> None:
    """The GPU-free SGLang harness is development support: the tests and benchmarks import it."""
    root = PACKAGE.parent.parent
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(root), "--no-deps", "-q", "-w", str(tmp_path)],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("trio_sglang-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packages = {name.split("/")[0] for name in archive.namelist()}
        assert "trio_sglang/sim/_sim_engine.py" in archive.namelist()
        assert not [name for name in archive.namelist() if "harness" in name]
    assert {name for name in packages if not name.endswith(".dist-info")} == {"trio_sglang"}


def _imported(path: Path, root: Path = PACKAGE.parent) -> set[str]:
    """Every module ``path`` imports, anywhere in it, named as from ``root`` on sys.path."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(
    "path",
    [
        *LIFECYCLE,
        *sorted((PACKAGE / "server").glob("*.py")),
    ],
    ids=lambda path: str(path.relative_to(PACKAGE)),
)
def test_the_lifecycle_and_the_server_never_import_the_simulator(path: Path) -> None:
    sim = sorted(
        name
        for name in _imported(path)
        if name == "trio_sglang.sim" or name.startswith(("trio_sglang.sim.", "trio_sglang._sim"))
    )
    assert sim == [], f"{path.name} imports the simulator: {sim}"


@pytest.mark.parametrize("name", BENEATH_THE_CORE)
def test_what_the_lifecycle_stands_on_never_imports_it(name: str) -> None:
    """The core sits on the engine protocol and SGLang's request checks, never the reverse."""
    core = sorted(
        imported
        for imported in _imported(PACKAGE / name)
        if imported.startswith("trio_sglang._core")
    )
    assert core == [], f"{name} imports the lifecycle: {core}"


def test_the_package_root_holds_few_modules_and_no_two_modules_share_a_name() -> None:
    """A name found in a traceback or a grep says which module it is, wherever it sits."""
    root = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_MODULES, f"{len(root)} modules in the package root: {root}"
    names: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__init__.py" and "_sgl_kernel_standin" not in path.parts:
            names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert shared == {}, f"modules that share a name: {shared}"


def test_no_test_helper_shares_a_name_with_a_benchmark_module() -> None:
    """The tests import the benchmarks' modules by bare name, beside their own helpers."""
    tests = {path.name for path in Path(__file__).parent.glob("*.py")}
    benchmarks = {path.name for path in BENCHMARKS.glob("*.py")}
    assert sorted(tests & benchmarks) == []


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize(
    ("folder", "root"),
    [(PACKAGE, PACKAGE.parent), (BENCHMARKS, BENCHMARKS)],
    ids=["package", "benchmarks"],
)
def test_there_is_no_import_cycle(folder: Path, root: Path) -> None:
    """No module imports itself back, lazily or for type checking either.

    ``root`` is the folder on sys.path: the benchmarks run as scripts with their
    own folder there, so they import each other by bare name (``import _report``).
    A package's ``from . import sim`` names the package, not a way back to it.
    """
    modules = {_module_name(path, root): path for path in folder.rglob("*.py")}
    graph = {
        name: sorted(_imported(path, root) & modules.keys() - {name})
        for name, path in modules.items()
    }
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycle = [*trail[trail.index(name) :], name]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for imported in graph[name]:
            visit(imported, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert len(done) == len(modules) > 40


@pytest.mark.parametrize("mode", [None, "prefill", "decode"])
async def test_the_engine_factory_gives_serve_a_sim_engine_and_the_rooms_to_host(
    mode: DisaggregationMode | None,
) -> None:
    options = EngineOptions(disaggregation_mode=mode, sim_args={"token_interval": 0.5})
    async with open_engine(options) as (engine, hosted):
        assert isinstance(engine, SimEngine)
        assert engine.timing.token_interval == 0.5
        assert engine.disaggregation_mode == mode
        # Only a prefill side hosts its rooms (SGLang's bootstrap server); a
        # decode side reaches its prefill peers' rooms over HTTP.
        if mode == "prefill":
            assert isinstance(hosted, SimKVRooms)
        else:
            assert hosted is None
        # The metrics know the simulator by this protocol only.
        assert isinstance(engine, CountsEvents)
        metrics = ServerMetrics()
        async with trio_sglang.open_worker(engine) as worker:
            metrics.watch(worker)
            assert 'trio_sglang_sim_events_total{kind="abort_lost"} 0.0' in (
                metrics.render().decode()
            )
