"""The README's two commands work on a machine whose system Python forbids ``pip install``.

Debian's and Ubuntu's Python is "externally managed" (PEP 668): ``python3 -m pip
install nox`` fails there, so the README's commands make a virtual environment
first. This runs their set-up part as written with such a Python (the system's,
where it is one), checks that a plain ``pip install`` is refused by it, and that
the environment they make can run the project's nox sessions. CI runs the test
command itself, exactly as written (``.ci/run``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from _readme import ROOT

#: Where an externally managed Python usually is (Debian, Ubuntu).
CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3")
PREFIX = "python3 -m venv .venv && .venv/bin/python -m pip install nox && "


def readme_commands() -> list[str]:
    """The README's two commands: the main job, then the tests."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^python3 -m venv .*-s (?:bench|tests)$", readme, flags=re.MULTILINE)
    return list(dict.fromkeys(commands))


def externally_managed_python() -> str | None:
    check = (
        "import os, sys, sysconfig; "
        "marker = os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED'); "
        "sys.exit(0 if os.path.isfile(marker) and sys.prefix == sys.base_prefix else 1)"
    )
    for candidate in CANDIDATES:
        python = shutil.which(candidate)
        if (
            python is not None
            and subprocess.run([python, "-c", check], check=False).returncode == 0
        ):
            return python
    return None


def test_the_readme_gives_the_main_job_and_the_tests_with_one_set_up() -> None:
    commands = readme_commands()
    assert [command.rsplit(" ", 1)[-1] for command in commands] == ["bench", "tests"]
    assert all(command.startswith(PREFIX) for command in commands)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci  # CI runs the test command exactly as written


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def test_the_readme_set_up_works_where_the_system_python_forbids_pip(tmp_path: Path) -> None:
    python = externally_managed_python()
    if python is None:
        pytest.skip(f"no externally managed Python (PEP 668) among {', '.join(CANDIDATES)}")
    refused = run([python, "-m", "pip", "install", "--dry-run", "nox"], tmp_path)
    assert refused.returncode != 0  # what the README used to tell users to run
    assert "externally-managed-environment" in refused.stdout + refused.stderr

    set_up = PREFIX.removesuffix(" && ").replace("python3", python, 1)
    made = run(["bash", "-c", set_up], tmp_path)
    assert made.returncode == 0, made.stderr
    sessions = run([str(tmp_path / ".venv" / "bin" / "python"), "-m", "nox", "--list"], ROOT)
    assert sessions.returncode == 0, sessions.stderr
    assert re.search(r"^[*-] bench\b", sessions.stdout, flags=re.MULTILINE)
    assert re.search(r"^[*-] tests\b", sessions.stdout, flags=re.MULTILINE)
