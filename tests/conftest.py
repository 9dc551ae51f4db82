"""Fixtures only (helpers live in ``tests/helpers.py``), and the tier markers.

Tiers mirror ``tests/``: ``unit`` (pure logic and files, no engine: ``make test-fast``, under a
minute), ``engine`` (a real tiny Phi-3-vision on vLLM, CPU), ``browser`` (the Chainlit UI in
headless Chromium). Each test gets its directory's marker, so ``pytest -m unit`` selects the
same tests as ``pytest tests/unit``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import IMAGES, start_server, stop_server

TIERS = ("unit", "engine", "browser")


def pytest_collection_modifyitems(config, items) -> None:
    """Mark each test with the tier of its directory."""
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def server():
    """The session's API server (tiny model, CPU defaults)."""
    # Generous latency targets: the autotuner test needs latency headroom even when the CI
    # machine's two cores are busy with other tests' clients.
    # An explicit start limit of 8 below the ceiling (32), so the autotuner has room to raise it
    # (by default auto starts at the KV-safe capacity, which is the ceiling on CPU).
    srv = start_server(["--slo-ttft-s", "30", "--slo-itl-s", "2", "--admission-limit", "8"])
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def images() -> Path:
    """Directory of the shared test images (``../shared/images``)."""
    assert IMAGES.is_dir(), f"missing {IMAGES}"
    return IMAGES
