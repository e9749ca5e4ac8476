"""README's client install for a CPU machine resolves to the CPU torch wheel
and no CUDA package (pip's resolver, as a person runs it: a dry run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT


def _resolved(tmp_path: Path, *args: str) -> dict[str, str]:
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"),
            *("--disable-pip-version-check", "-q", "--report", str(report), *args),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    installs = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}


def test_the_readmes_cpu_client_install_takes_the_cpu_torch_and_no_cuda(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    assert '`pip install -c constraints.txt ".[client]"`' in readme
    resolved = _resolved(tmp_path, "-c", "constraints.txt", ".[client]")
    assert resolved["torch"].startswith("2.13.0")
    assert not [name for name in resolved if name.startswith("nvidia")], resolved
