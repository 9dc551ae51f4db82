"""The route table (``serve/routes.py``) against vLLM's real app, enumerated at runtime."""

from __future__ import annotations

import pytest

from serve.routes import CLOSED, GENERATE, OPTIONAL, SERVED, RouteTable
from tests.helpers import TINY_MODEL, serve_cli


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
    res = serve_cli("--model", str(TINY_MODEL), "--open-routes", "/inference/v1/generate")
    assert res.returncode == 2 and "--open-routes accepts only" in res.stderr
    assert "Traceback" not in res.stderr
