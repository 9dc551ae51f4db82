"""Every route of vLLM's app as it runs, classified by ``serve/routes.py`` and enforced."""

from __future__ import annotations

import httpx

from serve.routes import CLOSED, OPTIONAL, VLLM_ROUTES


def _probe(client: httpx.Client, base: str, path: str, methods: list[str]) -> int:
    url = base + path.replace("{response_id}", "resp_x")
    if "POST" in methods:
        return client.post(url, json={}).status_code
    return client.get(url).status_code


def test_every_vllm_route_is_classified_and_enforced(server):
    """The routes of vLLM's app *as it runs* (not a copied list): each one is in the table,
    closed and optional ones answer 404, served ones answer."""
    table = httpx.get(f"{server.base_url}/admin/routes", timeout=10).json()
    own = {r["path"] for r in table["routes"] if r["policy"] == "own"}
    live = {r["path"] for r in table["routes"] if r["policy"] != "own"}
    assert table["unclassified"] == [], "vLLM serves routes serve/routes.py does not classify"
    assert {"/health", "/ready", "/metrics", "/limits", "/admin/routes"} <= own
    assert {"/v1/chat/completions", "/v1/responses", "/scale_elastic_ep"} <= live
    assert live <= set(VLLM_ROUTES) | {"/docs", "/redoc", "/openapi.json"}
    with httpx.Client(timeout=30) as client:
        for route in table["routes"]:
            status = _probe(client, server.base_url, route["path"], route["methods"])
            assert route["open"] == (route["policy"] not in (CLOSED, OPTIONAL)), route
            if not route["open"]:
                assert status == 404, route
            else:
                assert status != 404, route
        closed = client.post(f"{server.base_url}/is_scaling_elastic_ep")
        assert closed.status_code == 404
        assert closed.json()["error"]["type"] == "not_found_error"
        assert client.get(f"{server.base_url}/v1/models").status_code == 200
