"""Every shell block of README.md and docs/*.md is either run by a test,
named in a comment right above it (`<!-- run by tests/... -->`), or says why
not (`<!-- not run by the tests: ... -->`: a GPU, a hub model, a Docker
engine, hosts that stand for yours). And the blocks no other test runs are
run here, as written but for free ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from .conftest import ROOT
from .test_process import free_port, wait_serving

FENCE = re.compile(r"^```(?:sh|bash|shell|console)\n", re.MULTILINE)
RUN_BY = re.compile(r"<!-- run by (tests/[\w/]+\.py)(?:::(\w+))?[ ,(]")
NOT_RUN = re.compile(r"<!-- not run by the tests: \S.{20,} -->")


def shell_blocks() -> list[tuple[str, str, str]]:
    """(where, the line above, the block) of each shell block."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            above = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            block = text[match.end() :].split("\n```", 1)[0]
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", above, block))
    return found


def block_after(doc: str, marker: str) -> str:
    text = (ROOT / doc).read_text()
    start = text.index(marker)
    fence = FENCE.search(text, start)
    assert fence is not None
    return text[fence.end() :].split("\n```", 1)[0]


def test_every_shell_block_is_run_by_a_test_or_says_why_not() -> None:
    blocks = shell_blocks()
    assert len(blocks) >= 15
    for where, above, _ in blocks:
        run_by = RUN_BY.search(above + " ")
        if run_by is None:
            assert NOT_RUN.fullmatch(above), f"{where}: neither run by a test nor saying why not"
            continue
        test_file = ROOT / run_by[1]
        assert test_file.is_file(), f"{where}: {run_by[1]} does not exist"
        source = test_file.read_text()
        if run_by[2] is not None:
            assert f"def {run_by[2]}(" in source, f"{where}: no test {run_by[2]} in {run_by[1]}"
        doc = where.split(":")[0]
        named = doc if doc != "README.md" else "README"
        assert named in source or doc.split("/")[-1] in source, (
            f"{where}: {run_by[1]} does not read {doc}"
        )


def test_make_serve_runs_the_server_with_its_defaults() -> None:
    """README's set-up: `make serve` serves (on free ports: 50051 may be taken)."""
    readme = (ROOT / "README.md").read_text()
    assert "make serve   # installs into .venv and runs the server with its defaults" in readme
    port, metrics = free_port(), free_port()
    env = {**os.environ, "MMCACHE_PORT": str(port), "MMCACHE_METRICS_PORT": str(metrics)}
    proc = subprocess.Popen(
        ["make", "serve"], cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_serving(port, proc)
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a person stops it
        said, _ = proc.communicate(timeout=30)
    assert "Traceback" not in said, said


def test_the_deploy_checks_run_as_written() -> None:
    """docs/deploy.md's checks, after `make serve`: all but its last line,
    which is tests/deploy (make test runs it)."""
    block = block_after("docs/deploy.md", "test_the_deploy_checks_run_as_written")
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    assert lines[-1].endswith("pytest tests/deploy")
    for line in lines[:-1]:
        started = time.monotonic()
        done = subprocess.run(line, shell=True, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, (
            f"{line} ({time.monotonic() - started:.0f}s):\n{done.stdout}{done.stderr}"
        )
    assert "all deploy checks passed" in done.stdout


@pytest.mark.parametrize("doc", ["README.md", "docs/vllm.md"])
def test_the_vllm_quick_start_is_one_block_in_readme_and_docs(doc: str) -> None:
    """Written once, shown twice: README's block is docs/vllm.md's, which
    tests/vllm/test_quickstart.py runs as written."""
    marker = "<!-- run by tests/vllm/test_quickstart.py -->"
    assert block_after(doc, marker) == block_after("docs/vllm.md", marker)
