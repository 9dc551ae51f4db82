"""The usage store (``serve.usage``: SQLite, batched writes) and ``GET /admin/usage``
(``serve.accounting``)."""

from __future__ import annotations

import datetime
import sqlite3
import threading

import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from serve.accounting import Accounting, start_tenants, usage_db_path
from serve.metrics import Metrics
from serve.quota import Quota
from serve.settings import Settings
from serve.tenants import ANONYMOUS, TENANT_SCOPE_KEY, Tenant, TenantLimits
from serve.usage import UsageStore, UsageStoreError

#: 2025-06-10 12:00 UTC.
NOON = datetime.datetime(2025, 6, 10, 12, tzinfo=datetime.timezone.utc).timestamp()
DAY = 86400


class Clock:
    def __init__(self, now: float = NOON) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def rows(path) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT day, tenant, user, requests, prompt_tokens FROM usage "
                          "ORDER BY day, tenant, user").fetchall()


def test_totals_survive_closing_and_reopening_the_file(tmp_path):
    path, clock = tmp_path / "usage.sqlite3", Clock()
    store = UsageStore(path, clock)
    store.add("acme", requests=1, prompt_tokens=100, completion_tokens=20, image_tokens=60,
              good_requests=1)
    store.add("acme", requests=1, refusal="tokens_per_minute")
    clock.now += DAY
    store.add("acme", requests=1, prompt_tokens=5, completion_tokens=5)
    store.close()

    again = UsageStore(path, clock)
    report = again.report(datetime.date(2025, 6, 1))
    assert report == {"since": "2025-06-01", "days": [
        {"day": "2025-06-10", "tenant": "acme", "requests": 2, "prompt_tokens": 100,
         "completion_tokens": 20, "image_tokens": 60, "good_requests": 1, "tokens": 120,
         "refusals": {"tokens_per_minute": 1}},
        {"day": "2025-06-11", "tenant": "acme", "requests": 1, "prompt_tokens": 5,
         "completion_tokens": 5, "image_tokens": 0, "good_requests": 0, "tokens": 10,
         "refusals": {}}]}
    assert again.tokens_since(datetime.date(2025, 6, 11)) == {"acme": 10}
    assert again.tokens_since(datetime.date(2025, 6, 1)) == {"acme": 130}
    again.add("acme", requests=1, prompt_tokens=1)  # adds to the row read back
    again.close()
    assert rows(path)[-1] == ("2025-06-11", "acme", "", 2, 6)
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_the_store_and_its_wal_are_readable_by_their_owner_only(tmp_path):
    # They name tenants and users, as the keys file names tenants (0600 both).
    path = tmp_path / "usage.sqlite3"
    store = UsageStore(path, Clock())
    store.add("acme", user="alice", requests=1)
    store.flush()
    files = [p for p in tmp_path.iterdir() if p.name.startswith("usage.sqlite3")]
    assert path in files and len(files) >= 2  # the WAL is open beside it
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == dict.fromkeys(
        (p.name for p in files), 0o600)
    store.close()


def test_writes_are_batched_in_memory_until_a_flush(tmp_path):
    path = tmp_path / "usage.sqlite3"
    store = UsageStore(path, Clock())
    for _ in range(1000):
        store.add("acme", requests=1, prompt_tokens=2)
    assert rows(path) == []  # nothing written yet: add() only counts in memory
    assert store.flush() == 1  # a thousand requests, one row upserted
    assert rows(path) == [("2025-06-10", "acme", "", 1000, 2000)]
    assert store.flush() == 0
    store.close()


def test_the_writer_thread_flushes_every_interval(tmp_path):
    path = tmp_path / "usage.sqlite3"
    store = UsageStore(path, Clock(), flush_interval_s=0.05)
    written = threading.Event()
    flush = store.flush

    def watched() -> int:
        n = flush()
        if n:
            written.set()
        return n

    store.flush = watched
    store.start()
    store.add("acme", requests=1)
    assert written.wait(5)
    assert rows(path) == [("2025-06-10", "acme", "", 1, 0)]
    store.close()


def test_quota_budgets_start_from_the_store(tmp_path):
    path, clock = tmp_path / "usage.sqlite3", Clock()
    store = UsageStore(path, clock)
    store.add("acme", prompt_tokens=300, completion_tokens=100)  # today
    clock.now -= 5 * DAY
    store.add("acme", prompt_tokens=1000)  # earlier this month
    clock.now -= 30 * DAY
    store.add("acme", prompt_tokens=10**6)  # last month
    store.close()
    clock.now = NOON
    acme = Tenant("acme", limits=TenantLimits(tokens_per_day=1000, tokens_per_month=2800))
    metrics = Metrics(CollectorRegistry())
    accounting = Accounting(Quota(clock), UsageStore(path, clock), metrics, [acme])
    assert accounting.quota.tokens_today("acme") == 400
    assert accounting.quota.tokens_this_month("acme") == 1400
    assert metrics.registry.get_sample_value("phi3v_tenant_budget_used_ratio",
                                             {"tenant": "acme", "period": "month"}) == 0.5
    refusal = accounting.quota.check(acme, 700)
    assert refusal.limit == "tokens_per_day"
    accounting.close()


def test_where_the_store_lives_and_which_tenants_are_known_at_start(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text('{"version": 1, "tenants": {"acme": {"limits": {"tokens_per_day": 10}}},'
                    ' "keys": []}')
    assert usage_db_path(Settings()) == ":memory:"
    assert usage_db_path(Settings(keys_file=keys)) == str(tmp_path / "usage.sqlite3")
    assert usage_db_path(Settings(keys_file=keys, usage_db=tmp_path / "u.db")) == str(
        tmp_path / "u.db")
    assert [t.name for t in start_tenants(Settings(keys_file=keys))] == ["acme"]
    assert [t.name for t in start_tenants(Settings(keys_file=keys, api_keys=["k"]))] == [
        "acme", "default"]
    assert start_tenants(Settings()) == [ANONYMOUS]


# --- GET /admin/usage -------------------------------------------------------------------------
def admin_app(accounting: Accounting, tenant: Tenant) -> TestClient:
    """The route as the gateway serves it, behind a stand-in for auth (puts ``tenant`` in the
    scope)."""
    inner = Starlette(routes=[Route("/admin/usage", accounting.usage_page)])

    async def app(scope, receive, send):
        scope[TENANT_SCOPE_KEY] = tenant
        await inner(scope, receive, send)

    return TestClient(app)


def test_admin_usage_answers_totals_per_tenant_and_day_to_admins_only():
    clock = Clock()
    store = UsageStore(clock=clock)
    accounting = Accounting(Quota(clock), store, Metrics(CollectorRegistry()))
    store.add("chat-ui", "alice", requests=1, prompt_tokens=10, completion_tokens=1)
    store.add("chat-ui", "bob", requests=2, prompt_tokens=20, completion_tokens=2,
              refusal="max_concurrent")
    store.add("acme", requests=1, prompt_tokens=7)
    clock.now -= 40 * DAY  # last month: left out by default
    store.add("acme", requests=1, prompt_tokens=1000)
    clock.now = NOON

    admin = admin_app(accounting, Tenant("ops", admin=True))
    body = admin.get("/admin/usage").json()
    assert body["since"] == "2025-06-01" and body["persistent"] is False
    assert [(d["day"], d["tenant"]) for d in body["days"]] == [
        ("2025-06-10", "acme"), ("2025-06-10", "chat-ui")]
    ui = body["days"][1]
    assert (ui["requests"], ui["tokens"], ui["refusals"]) == (3, 33, {"max_concurrent": 1})
    assert [(u["user"], u["requests"], u["refusals"]) for u in ui["users"]] == [
        ("alice", 1, {}), ("bob", 2, {"max_concurrent": 1})]

    body = admin.get("/admin/usage", params={"since": "2025-04-01", "tenant": "acme"}).json()
    assert [(d["day"], d["tokens"]) for d in body["days"]] == [
        ("2025-05-01", 1000), ("2025-06-10", 7)]

    bad = admin.get("/admin/usage", params={"since": "June"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
    refused = admin_app(accounting, Tenant("acme")).get("/admin/usage")
    assert refused.status_code == 403
    assert refused.json()["error"]["type"] == "permission_error"


def test_a_store_that_cannot_open_names_its_file(tmp_path):
    with pytest.raises(UsageStoreError, match="missing/usage.sqlite3.*--usage-db"):
        UsageStore(tmp_path / "missing" / "usage.sqlite3")
    (tmp_path / "not-a-db").write_text("hello " * 100)
    with pytest.raises(UsageStoreError, match="not-a-db"):
        UsageStore(tmp_path / "not-a-db")
