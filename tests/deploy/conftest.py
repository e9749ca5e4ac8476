from __future__ import annotations

import pytest

from tests.deploy.podman import build_image


@pytest.fixture(scope="session")
def image() -> str:
    """The sidecar image, built once for every test that runs it."""
    return build_image()
