"""The docs' examples and the demo run exactly as written; the docs' links stay inside the repo."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from _readme import ROOT, readme_block
from trio_sglang._cli._parser import build_parser


def run_python(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_the_embedding_example_runs_as_written() -> None:
    example = readme_block("python", "the embedded default", "docs/embedding.md")
    result = run_python("-c", example)
    assert result.returncode == 0, result.stderr
    assert "killed: True; engine still holds: set()" in result.stdout
    assert "cancel_before_first_output_v1" in result.stdout


def test_the_disaggregation_example_stops_the_prefill_while_it_computes() -> None:
    result = run_python("-c", readme_block("python", "SimKVRooms()", "docs/disaggregation.md"))
    assert result.returncode == 0, result.stderr
    assert "prefill stopped: abort_applied in prefilling" in result.stdout
    assert "left live: set()" in result.stdout
    assert result.stdout.splitlines()[-1] == "True"  # cancel-anytime, advertised


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_the_docs_link_only_to_files_in_the_repository(doc: Path) -> None:
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "#")):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"
    for outside in ("../shared", "SPEC.md", "SGLANG_FACTS", "DYNAMO_FACTS"):
        assert outside not in text, f"{doc.name} names {outside}, which is not in the repository"


def test_the_readme_points_to_every_docs_page_and_shows_the_plot() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"the README does not link docs/{page.name}"
    assert "](benchmarks/results/latency.png)" in readme
    assert (ROOT / "benchmarks" / "results" / "latency.png").is_file()


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
