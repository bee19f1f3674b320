"""The README's embedding example and the demo run exactly as written."""

from __future__ import annotations

import subprocess
import sys

import pytest

from _readme import ROOT, readme_block
from trio_sglang._cli import build_parser


def run_python(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_readme_embedding_example_runs_as_written() -> None:
    example = readme_block("python", "the embedded default")
    result = run_python("-c", example)
    assert result.returncode == 0, result.stderr
    assert "killed: True; engine still holds: set()" in result.stdout
    assert "cancel_before_first_output_v1" in result.stdout


def test_readme_disaggregation_example_stops_the_prefill_while_it_computes() -> None:
    result = run_python("-c", readme_block("python", "SimKVRooms()"))
    assert result.returncode == 0, result.stderr
    assert "prefill stopped: abort_applied in prefilling" in result.stdout
    assert "left live: set()" in result.stdout
    assert result.stdout.splitlines()[-1] == "True"  # cancel-anytime, advertised


def test_readme_commands_are_the_ones_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = "python3 -m pip install nox && python3 -m nox -s tests"
    assert test_command in readme
    assert test_command in ci.splitlines()


def test_demo_leaves_nothing_at_the_engine() -> None:
    result = run_python("-m", "trio_sglang", "demo", "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert "engine holds 0 request(s) at the end" in result.stdout
    assert "['registered', 'released']" in result.stdout  # killed while tokenizing


@pytest.mark.parametrize(
    "bad", [["demo", "--max-new-tokens", "0"], ["demo", "--token-interval", "-1"], []]
)
def test_cli_rejects_bad_arguments(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(bad)
    assert exit_info.value.code == 2
