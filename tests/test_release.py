"""What a person deciding to adopt mmcache looks for first: a licence, and a
changelog whose newest entry is the version the package says it is."""

from __future__ import annotations

import tomllib

import mmcache

from .conftest import ROOT


def test_the_licence_is_apache_2_and_said_everywhere_it_is_looked_for() -> None:
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert "[LICENSE](LICENSE)" in (ROOT / "README.md").read_text()


def test_the_changelogs_newest_release_is_the_packages_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = [line for line in changelog.splitlines() if line.startswith("## 0.")]
    assert releases[0].startswith(f"## {mmcache.__version__} ")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == mmcache.__version__
    assert "## Versioning and deprecation" in changelog
