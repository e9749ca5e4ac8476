"""Podman for the deploy tests: the sidecar image (scripts/image-build.sh: a
Debian base made by mmdebstrap, the tested pins from a local wheelhouse), the
flags our CI machines need (scripts/podman-flags.sh), and a command runner."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from tests.conftest import ROOT

IMAGE = "localhost/mmcache:ci"
BASE_IMAGE = "localhost/mmcache-base:bookworm"  # scripts/image-build.sh makes it


def podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def podman_flags() -> list[str]:
    """PODMAN_FLAGS of scripts/podman-flags.sh, the one place they are kept."""
    flags = shlex.quote(str(ROOT / "scripts/podman-flags.sh"))
    script = f'. {flags}; printf "%s\\n" "${{PODMAN_FLAGS[@]}}"'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    return done.stdout.split()


def build_image() -> str:
    """The sidecar image, built as CI builds it; a skip where podman cannot run
    containers (the script says why)."""
    done = subprocess.run(
        [str(ROOT / "scripts/image-build.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={"PYTHON": str(ROOT / ".venv/bin/python"), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    if done.returncode == 77:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout.strip())  # the image's size, in the test log
    return IMAGE
