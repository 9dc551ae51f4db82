"""The route table (``serve/routes.py``) against vLLM's real app, enumerated at runtime."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from serve.routes import CLOSED, GENERATE, OPTIONAL, SERVED, VLLM_ROUTES, RouteTable
from tests.conftest import ROOT, TINY_MODEL


def test_policies_and_templates():
    table = RouteTable()
    assert table.policy("/v1/chat/completions") == GENERATE
    assert table.policy("/v1/responses") == GENERATE
    assert table.policy("/v1/completions") == GENERATE
    assert table.policy("/v1/models") == SERVED
    assert table.policy("/v1/responses/resp_123") == OPTIONAL
    assert table.policy("/v1/responses/resp_123/cancel") == OPTIONAL
    assert table.policy("/scale_elastic_ep") == CLOSED
    assert table.policy("/some/new/vllm/route") == CLOSED  # unknown: closed
    assert table.unclassified(["/v1/models", "/brand/new"]) == ["/brand/new"]
    opened = RouteTable(["/tokenize", "/v1/responses/{response_id}"])
    assert opened.policy("/tokenize") == SERVED and opened.policy("/v1/responses/r1") == SERVED
    with pytest.raises(ValueError, match="--open-routes accepts only"):
        RouteTable(["/scale_elastic_ep"])


def test_open_routes_refuses_a_closed_route_at_start():
    res = subprocess.run([sys.executable, "-m", "serve", "--model", str(TINY_MODEL),
                          "--open-routes", "/inference/v1/generate"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--open-routes accepts only" in res.stderr
    assert "Traceback" not in res.stderr


def _probe(client: httpx.Client, base: str, path: str, methods: list[str]) -> int:
    url = base + path.replace("{response_id}", "resp_x")
    if "POST" in methods:
        return client.post(url, json={}).status_code
    return client.get(url).status_code


def test_every_vllm_route_is_classified_and_enforced(server):
    """The routes of vLLM's app *as it runs* (not a copied list): each one is in the table,
    closed and optional ones answer 404, served ones answer."""
    table = httpx.get(f"{server.base_url}/admin/routes", timeout=10).json()
    live = {r["path"] for r in table["routes"]}
    assert table["unclassified"] == [], "vLLM serves routes serve/routes.py does not classify"
    assert {"/v1/chat/completions", "/v1/responses", "/scale_elastic_ep"} <= live
    assert live <= set(VLLM_ROUTES) | {"/docs", "/redoc", "/openapi.json"}
    with httpx.Client(timeout=30) as client:
        for route in table["routes"]:
            status = _probe(client, server.base_url, route["path"], route["methods"])
            if route["policy"] in (CLOSED, OPTIONAL):
                assert status == 404, route
            else:
                assert status != 404, route
        closed = client.post(f"{server.base_url}/is_scaling_elastic_ep")
        assert closed.status_code == 404
        assert closed.json()["error"]["type"] == "not_found_error"
        assert client.get(f"{server.base_url}/v1/models").status_code == 200
