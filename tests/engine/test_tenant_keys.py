"""Tenants and keys on the real server (``--keys-file``, ``serve.keys``, ``serve.auth``): a
tenant's key works, a key revoked with ``python -m serve.keys`` while the server runs is
refused within the reload check, an unknown and a revoked key get byte-identical 401s, only an
admin tenant reaches ``/admin/*``, ``--api-keys`` keeps working beside the file, SIGHUP
reloads instead of ending the process, and the access record names the tenant and the
``user``."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from serve.keys import RELOAD_CHECK_S
from tests.helpers import GATEWAY_KEY as PLAIN
from tests.helpers import add_key, keys_cli, log_lines


def key_ids(path) -> list[str]:
    return [k["id"] for k in json.loads(path.read_text())["keys"]]


@pytest.fixture(scope="module")
def keyed(gateway):
    """The session's ``gateway``: a keys file (tenants team-a, chat-ui as a trusted front end,
    ops as admin) and a plain ``--api-keys`` key; (server, keys file, tokens by tenant)."""
    return gateway.server, gateway.keys_file, gateway.tokens


def get(server, route: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.get(f"{server.base_url}{route}", headers=headers, timeout=30)


def chat(server, key: str, **fields) -> httpx.Response:
    body = {"model": server.model, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def test_keys_tenants_admin_and_the_plain_keys(keyed):
    srv, _, tokens = keyed
    assert chat(srv, tokens["team-a"]).status_code == 200
    assert get(srv, "/v1/models", PLAIN).status_code == 200
    assert get(srv, "/admin/autotuner", tokens["team-a"]).status_code == 403
    assert get(srv, "/admin/autotuner", tokens["chat-ui"]).status_code == 403
    assert get(srv, "/admin/autotuner", tokens["ops"]).status_code == 200
    assert get(srv, "/admin/autotuner", PLAIN).status_code == 200  # tenant default: admin
    refused = get(srv, "/admin/routes", tokens["team-a"])
    assert refused.json()["error"]["type"] == "permission_error"
    assert get(srv, "/health", None).status_code == 200


def test_the_access_record_names_the_tenant_and_the_user(keyed):
    srv, _, tokens = keyed
    ids = {}
    for tenant in ("chat-ui", "team-a"):
        r = chat(srv, tokens[tenant], user=f"alice-of-{tenant}")
        assert r.status_code == 200, r.text
        ids[r.headers["x-request-id"]] = tenant
    too_long = chat(srv, tokens["team-a"], user="u" * 257)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "user"
    records = {r["request_id"]: r for r in log_lines(srv, ids)
               if r["logger"] == "serve.access"}
    for request_id, tenant in ids.items():
        assert records[request_id]["tenant"] == tenant
        assert records[request_id]["user"] == f"alice-of-{tenant}"


def test_a_revoked_key_is_refused_within_the_check_and_like_an_unknown_one(keyed):
    srv, path, _ = keyed
    token = add_key(path, "team-a")
    deadline = time.monotonic() + 2 * RELOAD_CHECK_S + 1
    while get(srv, "/v1/models", token).status_code != 200:  # the new key, once loaded
        assert time.monotonic() < deadline, "a new key was not loaded"
        time.sleep(0.05)
    keys_cli(path, "revoke", key_ids(path)[-1])
    changed = time.monotonic()
    while get(srv, "/v1/models", token).status_code == 200:
        time.sleep(0.02)
    # one check interval, plus the last request's own time and the poll's
    assert time.monotonic() - changed < RELOAD_CHECK_S + 0.5
    revoked = get(srv, "/v1/models", token)
    unknown = get(srv, "/v1/models", "phi3v-" + "x" * 43)
    missing = get(srv, "/v1/models", None)
    for r in (revoked, unknown, missing):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.content == revoked.content
        assert r.headers["content-length"] == revoked.headers["content-length"]


def test_sighup_reloads_and_the_server_keeps_serving(keyed):
    srv, path, tokens = keyed
    os.kill(srv.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while not any("SIGHUP" in r.get("message", "") for r in log_lines(srv)):
        assert time.monotonic() < deadline, "no SIGHUP reload logged"
        time.sleep(0.1)
    assert srv.proc.poll() is None
    assert get(srv, "/v1/models", tokens["ops"]).status_code == 200
