"""Fixtures only (helpers live in ``tests/helpers.py``), and the tier markers.

Tiers mirror ``tests/``: ``unit`` (pure logic and files, no engine: ``make test-fast``, a few
minutes), ``engine`` (a real tiny Phi-3-vision on vLLM, CPU), ``browser`` (the Chainlit UI in
headless Chromium). Each test gets its directory's marker, so ``pytest -m unit`` selects the
same tests as ``pytest tests/unit``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import (
    GATEWAY_KEY,
    GATEWAY_MAX_BODY,
    GATEWAY_ORIGIN,
    GATEWAY_URL_HOSTS,
    IMAGES,
    JSON_LOGS,
    Server,
    add_key,
    start_server,
    stop_server,
)

TIERS = ("unit", "engine", "browser")


def _tier(item) -> str:
    return Path(str(item.fspath)).parent.name


def pytest_configure(config) -> None:
    """Drop the operator's ``PHI3V_*`` variables: every test sets what its server needs, and a
    keys file exported while following the README (``PHI3V_KEYS_FILE``) would put every test
    server behind keys its requests do not carry."""
    for name in [n for n in os.environ if n.startswith("PHI3V_")]:
        del os.environ[name]


def pytest_collection_modifyitems(config, items) -> None:
    """Mark each test with the tier of its directory, and run the tiers in the order of
    :data:`TIERS` (files in their order within a tier): the unit tier first, before any
    session server is started, so that its few timing checks never share the two cores with
    idle engines kept for the session's later tests."""
    for item in items:
        if _tier(item) in TIERS:
            item.add_marker(getattr(pytest.mark, _tier(item)))
    items.sort(key=lambda item: TIERS.index(_tier(item)) if _tier(item) in TIERS else len(TIERS))


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


@dataclass
class Gateway:
    """The session's server with the gateway's optional layers on (:func:`gateway`)."""

    server: Server
    keys_file: Path
    #: A token of each tenant of the keys file, by tenant name.
    tokens: dict[str, str]
    #: The OTLP collector its spans and vLLM's go to (``tests.otlp.Receiver``).
    receiver: object
    #: The ``--api-keys`` key (tenant ``default``, admin).
    plain: str = GATEWAY_KEY
    #: The one origin of ``--allowed-origins``.
    origin: str = GATEWAY_ORIGIN

    @property
    def auth(self) -> dict[str, str]:
        """Headers of the plain key."""
        return {"Authorization": f"Bearer {self.plain}"}


@pytest.fixture(scope="session")
def gateway(tmp_path_factory):
    """One server with every optional gateway layer that leaves the others' behaviour alone,
    shared by their tests (a start costs ~30 s): JSON logs, a keys file (tenants ``team-a``,
    ``chat-ui`` as a trusted front end, ``ops`` as admin) beside a plain ``--api-keys`` key,
    ``--allowed-origins``, ``--tools ignore``, traces to an OTLP receiver on loopback, image
    URLs fetched from an allowlist (only 127.0.0.2 an allowed network) and a 3 MiB body limit.
    Tests may add and revoke keys of their own; the three tenants' keys stay."""
    from tests.otlp import Receiver

    receiver = Receiver()
    path = tmp_path_factory.mktemp("gateway-keys") / "keys.json"
    tokens = {"team-a": add_key(path, "team-a"),
              "chat-ui": add_key(path, "chat-ui", "--trusted-frontend"),
              "ops": add_key(path, "ops", "--admin")}
    srv = start_server([*JSON_LOGS, "--keys-file", str(path),
                        "--api-keys", json.dumps([GATEWAY_KEY]),
                        "--allowed-origins", json.dumps([GATEWAY_ORIGIN]), "--tools", "ignore",
                        "--otlp-traces-endpoint", receiver.endpoint,
                        "--image-urls", "--image-url-allowlist", json.dumps(GATEWAY_URL_HOSTS),
                        "--image-url-allowed-networks", json.dumps(["127.0.0.2/32"]),
                        "--max-request-bytes", str(GATEWAY_MAX_BODY)],
                       # batches leave every 0.2 s; gRPC is vLLM's and the gateway's default
                       env={"OTEL_BSP_SCHEDULE_DELAY": "200",
                            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
                       name="gateway")
    try:
        yield Gateway(srv, path, tokens, receiver)
    finally:
        stop_server(srv)
        receiver.close()


@pytest.fixture(scope="session")
def verbose_server():
    """A server with the settings that change what other tests see, shared by their tests:
    JSON logs holding prompts (``--enable-log-requests``), tools handed to vLLM (``--tools
    pass``), images prepared in worker processes (``--image-workers 2``), cut Responses
    streams ending with OpenAI's ``response.incomplete`` event, and the benchmarks' endpoints
    with vLLM's per-step details (``--bench-admin --enable-logging-iteration-details``: a
    log line per engine step)."""
    srv = start_server([*JSON_LOGS, "--enable-log-requests", "--tools", "pass",
                        "--image-workers", "2", "--responses-incomplete-event", "incomplete",
                        "--bench-admin", "--enable-logging-iteration-details"],
                       name="verbose-server")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def images() -> Path:
    """Directory of the shared test images (``../shared/images``)."""
    assert IMAGES.is_dir(), f"missing {IMAGES}"
    return IMAGES
