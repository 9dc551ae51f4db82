"""Per-tenant limits (``serve.quota``) on an injected wall clock, and the quota layer
(``serve.accounting``) in front of a scripted peer."""

from __future__ import annotations

import datetime
import json

import pytest
from prometheus_client import CollectorRegistry

from serve.accounting import Accounting, refusal_response
from serve.asgi import PROMPT_TOKENS_SCOPE_KEY, REQUEST_STATE_KEY, response_channel
from serve.logs import AccessLog
from serve.metrics import Metrics
from serve.quota import WINDOW_S, Quota
from serve.tenants import TENANT_SCOPE_KEY, USER_SCOPE_KEY, Tenant, TenantLimits
from serve.usage import UsageStore

#: 2025-03-31 23:59:00 UTC: a minute before a new day and a new month.
END_OF_MARCH = datetime.datetime(2025, 3, 31, 23, 59, tzinfo=datetime.timezone.utc).timestamp()


class Clock:
    def __init__(self, now: float = END_OF_MARCH - 3600) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tenant(**limits) -> Tenant:
    return Tenant("acme", limits=TenantLimits(**limits))


def test_max_concurrent_counts_started_requests_until_they_finish():
    clock = Clock()
    quota, acme = Quota(clock), tenant(max_concurrent=2)
    first = quota.started(acme, 10)
    quota.started(acme, 10)
    refusal = quota.check(acme, 10)
    assert (refusal.limit, refusal.value, refusal.used) == ("max_concurrent", 2, 2)
    assert refusal.code == "max_concurrent_exceeded" and refusal.retry_after_s == 1  # no history
    assert "'acme'" in refusal.message and "max_concurrent limit of 2" in refusal.message
    clock.now += 8
    quota.finished(first, 10, 5)
    quota.finished(first, 10, 5)  # a ticket counts once
    assert quota.concurrent("acme") == 1 and quota.check(acme, 10) is None


def test_max_concurrent_retry_after_is_the_oldest_requests_expected_end():
    clock = Clock()
    quota, acme = Quota(clock), tenant(max_concurrent=1)
    ticket = quota.started(acme, 0)
    clock.now += 10  # a request takes 10 s
    quota.finished(ticket, 0, 0)
    quota.started(acme, 0)
    clock.now += 3
    assert quota.check(acme, 0).retry_after_s == 7


def test_requests_per_minute_slides_and_names_when_the_oldest_start_leaves():
    clock = Clock()
    quota, acme = Quota(clock), tenant(requests_per_minute=3)
    for _ in range(3):
        quota.finished(quota.started(acme, 1), 1, 0)
        clock.now += 10
    refusal = quota.check(acme, 1)  # starts at t0, t0+10, t0+20; now t0+30
    assert (refusal.limit, refusal.value, refusal.used) == ("requests_per_minute", 3, 3)
    assert refusal.retry_after_s == 30  # t0 leaves the window at t0+60
    assert refusal.code == "requests_per_minute_exceeded"
    clock.now += refusal.retry_after_s - 0.5
    assert quota.check(acme, 1) is not None
    clock.now += 0.5
    assert quota.check(acme, 1) is None  # the window slid: one start left it


def test_tokens_per_minute_counts_prompt_at_start_and_completion_at_end():
    clock = Clock()
    quota, acme = Quota(clock), tenant(tokens_per_minute=1000)
    ticket = quota.started(acme, 600)  # the intake's estimate, reserved
    clock.now += 5
    quota.finished(ticket, 500, 300)  # vLLM's count replaces it; completion counted now
    assert quota.tokens_last_minute("acme") == 800
    clock.now += 5
    refusal = quota.check(acme, 300)  # 800 + 300 > 1000
    assert (refusal.limit, refusal.value, refusal.used, refusal.requested) == (
        "tokens_per_minute", 1000, 800, 300)
    # 100 tokens must leave: the prompt (500, at t0) leaves at t0+60; now is t0+10.
    assert refusal.retry_after_s == 50
    assert "tokens_per_minute limit of 1000" in refusal.message
    assert quota.check(acme, 200) is None  # a smaller request fits now
    clock.now += 50
    assert quota.check(acme, 300) is None
    assert quota.tokens_last_minute("acme") == 300
    clock.now += 5
    assert quota.tokens_last_minute("acme") == 0  # the completion left at t0+65


def test_tokens_per_minute_retry_after_waits_for_enough_entries():
    clock = Clock()
    quota, acme = Quota(clock), tenant(tokens_per_minute=100)
    for _ in range(4):  # 25 tokens at t0, t0+1, t0+2, t0+3
        quota.finished(quota.started(acme, 25), 25, 0)
        clock.now += 1
    refusal = quota.check(acme, 60)  # 100 + 60 - 100: 60 must leave, three entries (75)
    assert refusal.retry_after_s == 60 + 2 - 4
    clock.now += refusal.retry_after_s
    assert quota.check(acme, 60) is None


def test_a_prompt_larger_than_the_limit_itself_never_passes():
    quota = Quota(Clock())
    refusal = quota.check(tenant(tokens_per_minute=100), 101)
    assert refusal.limit == "tokens_per_minute" and refusal.retry_after_s is None
    assert "alone exceeds" in refusal.message
    response = refusal_response(refusal)
    assert response.status_code == 429 and "retry-after" not in response.headers
    assert response.headers["x-phi3v-reject-reason"] == "tokens_per_minute"


def test_day_budget_refuses_until_the_next_utc_midnight_then_rolls_over():
    clock = Clock(END_OF_MARCH - 60)  # 23:58 UTC
    quota, acme = Quota(clock), tenant(tokens_per_day=1000)
    quota.finished(quota.started(acme, 900), 900, 50)
    assert quota.tokens_today("acme") == 950
    refusal = quota.check(acme, 100)
    assert (refusal.limit, refusal.value, refusal.used) == ("tokens_per_day", 1000, 950)
    assert refusal.retry_after_s == 120  # to 00:00 UTC
    assert quota.budget_used(acme, "day") == pytest.approx(0.95)
    clock.now += 120  # April 1st
    assert quota.tokens_today("acme") == 0 and quota.check(acme, 100) is None
    assert quota.budget_used(acme, "day") == 0


def test_month_budget_rolls_over_on_the_first_and_is_seeded_from_the_store():
    clock = Clock(END_OF_MARCH - 3 * 86400)  # March 28th
    quota, acme = Quota(clock), tenant(tokens_per_month=10_000, tokens_per_day=5000)
    quota.seed("acme", tokens_today=1000, tokens_this_month=9500)
    refusal = quota.check(acme, 600)
    assert refusal.limit == "tokens_per_month"  # the day still has room
    assert refusal.retry_after_s == 3 * 86400 + 60  # to April 1st 00:00 UTC
    assert quota.budget_used(acme, "month") == pytest.approx(0.95)
    clock.now += 86400  # March 29th: the day restarts, the month does not
    assert quota.tokens_today("acme") == 0 and quota.tokens_this_month("acme") == 9500
    clock.now = END_OF_MARCH + 60  # April 1st
    assert quota.tokens_this_month("acme") == 0 and quota.check(acme, 600) is None


def test_a_request_across_midnight_corrects_the_old_day_not_the_new_one():
    # Its prompt's estimate (4000) was counted in March 31; vLLM's count (0 here) arrives
    # on April 1: the new day and month start from the completion alone, never below 0.
    clock = Clock(END_OF_MARCH + 59)
    quota, acme = Quota(clock), tenant(tokens_per_day=5000, tokens_per_month=5000)
    ticket = quota.started(acme, 4000)
    clock.now += 2
    quota.finished(ticket, 0, 7)
    assert quota.tokens_today("acme") == 7 and quota.tokens_this_month("acme") == 7
    assert quota.check(acme, 5000).limit in ("tokens_per_day", "tokens_per_month")
    assert quota.check(acme, 4993) is None
    # Within one day, the correction applies as before.
    ticket = quota.started(acme, 100)
    quota.finished(ticket, 40, 0)
    assert quota.tokens_today("acme") == 47


def test_the_longest_retry_after_of_every_limit_exceeded_is_named():
    clock = Clock()
    quota = Quota(clock)
    acme = tenant(requests_per_minute=1, tokens_per_day=100)
    quota.finished(quota.started(acme, 100), 100, 0)
    refusal = quota.check(acme, 10)  # both: the minute frees first, the day later
    assert refusal.limit == "tokens_per_day" and refusal.retry_after_s > WINDOW_S


def test_tenants_are_counted_apart_and_unlimited_by_default():
    quota = Quota(Clock())
    acme, other = tenant(requests_per_minute=1), Tenant("other")
    quota.started(acme, 5)
    assert quota.check(acme, 5).limit == "requests_per_minute"
    for _ in range(100):
        assert quota.check(other, 10**6) is None
        quota.started(other, 10**6)


# --- the layer --------------------------------------------------------------------------------
def usage_peer(prompt: int, completion: int, status: int = 200):
    """vLLM's app: a JSON answer, its usage on the request's state as vLLM reports it, and
    admission's notes (admitted, goodput)."""
    from types import SimpleNamespace

    async def app(scope, receive, send):
        await receive()
        scope["state"]["request_metadata"] = SimpleNamespace(final_usage_info=SimpleNamespace(
            prompt_tokens=prompt, completion_tokens=completion))
        scope[REQUEST_STATE_KEY].update(queue_wait_s=0.0, goodput=True, status=status)
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})
    return app


async def call(app, who: Tenant, estimate: int, user: str | None = None):
    sent = []
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [],
             "query_string": b"", TENANT_SCOPE_KEY: who, PROMPT_TOKENS_SCOPE_KEY: estimate,
             REQUEST_STATE_KEY: {"image_tokens": 40}, "state": {}}
    if user is not None:
        scope[USER_SCOPE_KEY] = user
    channel = response_channel(send)
    with AccessLog(str, enabled=False).request(scope, channel):  # the state layers note on
        await app(scope, receive, channel)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body), dict(start["headers"]), scope[REQUEST_STATE_KEY]


def sample(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def test_the_layer_refuses_429_naming_the_limit_and_bills_vllms_count():
    clock = Clock()
    metrics = Metrics(CollectorRegistry())
    acme = tenant(tokens_per_minute=1000)
    accounting = Accounting(Quota(clock), UsageStore(clock=clock), metrics, [acme])
    app = accounting.wrap(usage_peer(prompt=700, completion=200))

    status, _, _, state = await call(app, acme, estimate=650)
    assert status == 200
    assert accounting.quota.tokens_last_minute("acme") == 900  # vLLM's 700 + 200
    assert accounting.quota.concurrent("acme") == 0

    status, body, headers, state = await call(app, acme, estimate=650)
    assert status == 429 and state["reject_reason"] == "tokens_per_minute"
    assert headers[b"x-phi3v-reject-reason"] == b"tokens_per_minute"
    assert int(headers[b"retry-after"]) == 60
    error = body["error"]
    assert error["code"] == "tokens_per_minute_exceeded"
    assert error["type"] == "rate_limit_exceeded"
    assert "'acme'" in error["message"] and "limit of 1000" in error["message"]

    assert sample(metrics, "phi3v_tenant_requests_total", tenant="acme") == 2
    assert sample(metrics, "phi3v_tenant_refusals_total", tenant="acme",
                  reason="tokens_per_minute") == 1
    assert sample(metrics, "phi3v_tenant_tokens_total", tenant="acme", kind="prompt") == 700
    assert sample(metrics, "phi3v_tenant_tokens_total", tenant="acme", kind="completion") == 200
    assert sample(metrics, "phi3v_tenant_tokens_total", tenant="acme", kind="image") == 40
    assert sample(metrics, "phi3v_tenant_good_requests_total", tenant="acme") == 1
    [day] = accounting.store.report(datetime.date(2025, 1, 1))["days"]
    assert (day["tenant"], day["requests"], day["tokens"], day["refusals"]) == (
        "acme", 2, 900, {"tokens_per_minute": 1})


async def test_the_layer_holds_a_concurrent_slot_while_the_request_runs():
    import asyncio

    clock = Clock()
    acme = tenant(max_concurrent=1)
    accounting = Accounting(Quota(clock), UsageStore(clock=clock), Metrics(CollectorRegistry()))
    release = asyncio.Event()

    async def slow(scope, receive, send):
        await release.wait()
        await usage_peer(1, 1)(scope, receive, send)

    app = accounting.wrap(slow)
    first = asyncio.ensure_future(call(app, acme, 1))
    await asyncio.sleep(0)
    status, body, headers, _ = await call(app, acme, 1)
    assert status == 429 and body["error"]["code"] == "max_concurrent_exceeded"
    assert headers[b"retry-after"] == b"1"
    release.set()
    assert (await first)[0] == 200
    assert (await call(app, acme, 1))[0] == 200


async def test_a_trusted_front_ends_users_are_accounted_apart():
    clock = Clock()
    ui = Tenant("chat-ui", trusted_frontend=True)
    accounting = Accounting(Quota(clock), UsageStore(clock=clock), Metrics(CollectorRegistry()))
    app = accounting.wrap(usage_peer(10, 5))
    await call(app, ui, 10, user="alice")
    await call(app, ui, 10, user="bob")
    await call(app, Tenant("api"), 10, user="carol")  # only recorded: not a front end
    days = accounting.store.report(datetime.date(2025, 1, 1))["days"]
    by_tenant = {d["tenant"]: d for d in days}
    assert [u["user"] for u in by_tenant["chat-ui"]["users"]] == ["alice", "bob"]
    assert by_tenant["chat-ui"]["tokens"] == 30 and "users" not in by_tenant["api"]


def test_budget_gauges_exist_only_for_budgets_and_follow_the_quota():
    clock = Clock()
    metrics = Metrics(CollectorRegistry())
    capped, free = tenant(tokens_per_day=1000), Tenant("free")
    accounting = Accounting(Quota(clock), UsageStore(clock=clock), metrics, [capped, free])
    accounting.quota.finished(accounting.quota.started(capped, 250), 250, 0)
    assert sample(metrics, "phi3v_tenant_budget_used_ratio", tenant="acme",
                  period="day") == 0.25
    assert metrics.registry.get_sample_value("phi3v_tenant_budget_used_ratio",
                                             {"tenant": "acme", "period": "month"}) is None
    assert metrics.registry.get_sample_value("phi3v_tenant_budget_used_ratio",
                                             {"tenant": "free", "period": "day"}) is None
    # Every series of a known tenant exists at 0 before its first request.
    assert metrics.registry.get_sample_value("phi3v_tenant_refusals_total",
                                             {"tenant": "free", "reason": "queue_full"}) == 0
