"""Tenant limits and usage on a real server with a keys file (``serve.accounting``): each
limit refuses with its name (429, ``Retry-After``, ``X-Phi3v-Reject-Reason``), the per-tenant
series are on ``/metrics``, and usage survives a restart on the same usage store."""

from __future__ import annotations

import asyncio
import datetime
import time

import httpx
import pytest

from tests.helpers import add_key, start_server, stop_server

#: Tokens every budgeted tenant may use: one answer of :data:`ANSWER_TOKENS` plus its short
#: prompt (8 tokens) fits, a second request does not.
BUDGET = 60
#: Completion tokens of each request (``ignore_eos``: exactly this many).
ANSWER_TOKENS = 50
#: name -> ``python -m serve.keys add`` flags.
TENANTS = {
    "ops": ["--admin"],
    "single": ["--max-concurrent", "1"],
    "rpm": ["--requests-per-minute", "2"],
    "tpm": ["--tokens-per-minute", str(BUDGET)],
    "daily": ["--tokens-per-day", str(BUDGET)],
    "monthly": ["--tokens-per-month", str(BUDGET)],
    "responses": [],
    "left": [],
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """The keys file and a token of each tenant of :data:`TENANTS`."""
    path = tmp_path_factory.mktemp("tenants") / "keys.json"
    return path, {name: add_key(path, name, *flags) for name, flags in TENANTS.items()}


def body(server, max_tokens: int = ANSWER_TOKENS, stream: bool = False) -> dict:
    return {"model": server.model, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, "messages": [{"role": "user", "content": "Hi"}]}


def post(server, token: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120,
                      json=body(server, **kwargs), headers={"Authorization": f"Bearer {token}"})


def assert_refused(response: httpx.Response, limit: str, retry_within_s: float) -> None:
    """A 429 naming ``limit`` with a ``Retry-After`` in 1..``retry_within_s``."""
    assert response.status_code == 429, response.text
    assert response.headers["x-phi3v-reject-reason"] == limit
    assert 1 <= int(response.headers["retry-after"]) <= retry_within_s
    error = response.json()["error"]
    assert error["code"] == f"{limit}_exceeded" and error["type"] == "rate_limit_exceeded"
    assert f"{limit} limit of" in error["message"]


def seconds_to_utc_midnight() -> float:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (datetime.datetime.combine(now.date() + datetime.timedelta(days=1), datetime.time(),
                                      datetime.timezone.utc) - now).total_seconds()


#: Completion tokens of the first request of :func:`_while_one_streams`: all the context
#: leaves (``max_model_len`` 4096), so it cannot end before the second one is answered.
LONG_ANSWER_TOKENS = 4000


async def _while_one_streams(server, token: str) -> tuple[int, httpx.Response]:
    """A second request of ``token``'s tenant sent while its first one streams; the first is
    then closed (the client leaves, which ends it)."""
    headers = {"Authorization": f"Bearer {token}"}
    url = f"{server.base_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", url, headers=headers,
                                 json=body(server, LONG_ANSWER_TOKENS, stream=True)) as first:
            lines = first.aiter_lines()
            await anext(lines)  # its first event: it is running
            second = await client.post(url, headers=headers, json=body(server, 1))
            return first.status_code, second


def test_each_limit_refuses_by_name_and_usage_survives_a_restart(keys):
    path, tokens = keys
    usage_db = path.parent / "usage.sqlite3"  # the default: next to the keys file
    server = start_server(["--keys-file", str(path)], name="tenant-limits")
    try:
        calibrate = post(server, tokens["ops"])
        assert calibrate.status_code == 200, calibrate.text
        usage = calibrate.json()["usage"]
        assert usage["completion_tokens"] == ANSWER_TOKENS
        # One request fits every budget; a second does not (what is left is less than its
        # prompt, counted at its start at the intake's estimate).
        left = BUDGET - usage["prompt_tokens"] - ANSWER_TOKENS
        assert 0 <= left < usage["prompt_tokens"] // 2, usage

        first, second = asyncio.run(_while_one_streams(server, tokens["single"]))
        assert first == 200
        assert_refused(second, "max_concurrent", 60)

        assert [post(server, tokens["rpm"], max_tokens=1).status_code for _ in range(2)] == [
            200, 200]
        assert_refused(post(server, tokens["rpm"], max_tokens=1), "requests_per_minute", 60)

        assert post(server, tokens["tpm"]).status_code == 200
        assert_refused(post(server, tokens["tpm"]), "tokens_per_minute", 60)

        assert post(server, tokens["daily"]).status_code == 200
        assert_refused(post(server, tokens["daily"]), "tokens_per_day",
                       seconds_to_utc_midnight() + 5)

        assert post(server, tokens["monthly"]).status_code == 200
        assert_refused(post(server, tokens["monthly"]), "tokens_per_month", 31 * 86400)

        # Where vLLM reports no usage, the answer is billed as it went out: the Responses
        # API's own count, and the tokens streamed to a client that left before the end.
        answer = httpx.post(f"{server.base_url}/v1/responses", timeout=120, json={
            "model": server.model, "input": "Hi", "max_output_tokens": ANSWER_TOKENS},
            headers={"Authorization": f"Bearer {tokens['responses']}"})
        assert answer.status_code == 200, answer.text
        output_tokens = answer.json()["usage"]["output_tokens"]
        assert output_tokens > 0
        seen = _stream_then_leave(server, tokens["left"], after_events=20)
        billed = _wait_for_metric(server, "phi3v_tenant_tokens_total",
                                  {"tenant": "left", "kind": "completion"})
        assert seen <= billed <= seen + 4, (seen, billed)  # a few were in flight

        # The per-tenant series, labelled with the tenants' names.
        scrape = server.metrics()
        assert server.metric("phi3v_tenant_tokens_total",
                             {"tenant": "responses", "kind": "completion"}, scrape) == \
            output_tokens
        assert server.metric("phi3v_tenant_requests_total", {"tenant": "rpm"}, scrape) == 3
        assert server.metric("phi3v_tenant_refusals_total",
                             {"tenant": "rpm", "reason": "requests_per_minute"}, scrape) == 1
        assert server.metric("phi3v_tenant_tokens_total",
                             {"tenant": "tpm", "kind": "completion"}, scrape) == ANSWER_TOKENS
        assert server.metric("phi3v_tenant_tokens_total",
                             {"tenant": "tpm", "kind": "prompt"}, scrape) == \
            usage["prompt_tokens"]
        daily = server.metric("phi3v_tenant_budget_used_ratio",
                              {"tenant": "daily", "period": "day"}, scrape)
        assert daily == pytest.approx((usage["prompt_tokens"] + ANSWER_TOKENS) / BUDGET)
        server.metric("phi3v_tenant_good_requests_total", {"tenant": "ops"}, scrape)
        labels = {dict(lbl).get("tenant") for (name, lbl), _ in scrape.items()
                  if name.startswith("phi3v_tenant_")}
        assert labels == set(TENANTS)  # names from the file, never a key

        admin = {"Authorization": f"Bearer {tokens['ops']}"}
        refused = httpx.get(f"{server.base_url}/admin/usage", timeout=10,
                            headers={"Authorization": f"Bearer {tokens['rpm']}"})
        assert refused.status_code == 403
        before = httpx.get(f"{server.base_url}/admin/usage", headers=admin, timeout=10).json()
    finally:
        stop_server(server)
    assert usage_db.exists()

    server = start_server(["--keys-file", str(path), "--usage-db", str(usage_db)],
                          name="tenant-limits-restarted")
    try:
        after = httpx.get(f"{server.base_url}/admin/usage", headers=admin, timeout=10).json()
        assert after["persistent"] is True
        assert after["days"] == before["days"]
        by_tenant = {d["tenant"]: d for d in after["days"]}
        assert by_tenant["rpm"]["requests"] == 3
        assert by_tenant["rpm"]["refusals"] == {"requests_per_minute": 1}
        assert by_tenant["tpm"]["completion_tokens"] == ANSWER_TOKENS
        # The day's budget starts from the store: still spent after the restart.
        assert_refused(post(server, tokens["daily"]), "tokens_per_day",
                       seconds_to_utc_midnight() + 5)
        only = httpx.get(f"{server.base_url}/admin/usage", headers=admin, timeout=10,
                         params={"tenant": "daily"}).json()
        assert {d["tenant"] for d in only["days"]} == {"daily"}
    finally:
        stop_server(server)


def _stream_then_leave(server, token: str, after_events: int) -> int:
    """Stream a long answer, close the connection after ``after_events`` token events;
    the events received."""
    seen = 0
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=120,
                      json=body(server, max_tokens=500, stream=True),
                      headers={"Authorization": f"Bearer {token}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                seen += 1
                if seen >= after_events:
                    break
    return seen


def _wait_for_metric(server, name: str, labels: dict, timeout_s: float = 10.0) -> float:
    """The series' value once it is above 0 (an answer is billed when its request ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = server.metric(name, labels)
        except KeyError:  # not counted yet
            value = 0.0
        if value > 0 or time.monotonic() > deadline:
            return value
        time.sleep(0.2)
