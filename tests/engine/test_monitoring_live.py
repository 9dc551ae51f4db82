"""Monitoring end to end: a real Prometheus scraping the live stack (engine tier)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from tests.helpers import (
    ARTIFACTS,
    ManagedServer,
    data_url,
    free_port,
    start_process,
    stop_process,
)
from tests.unit.test_monitoring import (  # shared with the file checks of the unit tier
    DASHBOARDS,
    GRAFANA_BUILTINS,
    JOB,
    PROM_DIR,
    PROMETHEUS_YML,
    _alert_rules,
    _binary,
    _dashboard,
    _metric_names,
    _queries,
    _recording_rules,
)


# --- end to end: a real Prometheus on the live stack --------------------------------------------
class Prometheus(ManagedServer):
    """A ``prometheus`` server started for this module (``bench.process``)."""

    def get(self, path: str, **params) -> dict:
        r = httpx.get(f"{self.url}{path}", params=params, timeout=30)
        body = r.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.get("/api/v1/query", **params)["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


def _test_config(target: str) -> dict:
    """monitoring/prometheus/prometheus.yml, pointed at ``target``, scraping and evaluating
    every second, with absolute rule paths and no Alertmanager."""
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str((PROM_DIR / f).resolve()) for f in cfg["rule_files"]]
    cfg.pop("alerting", None)
    [job] = [j for j in cfg["scrape_configs"] if j["job_name"] == JOB]
    job.update(scrape_interval="1s", scrape_timeout="1s")
    job["static_configs"] = [{"targets": [target]}]
    return cfg


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = _binary("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(_test_config(urlparse(server.base_url).netloc)))
    port = free_port()
    prom = start_process(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
        port, ARTIFACTS / "prometheus.log", "/-/ready", ready_timeout_s=30,
        server_cls=Prometheus)
    try:
        yield prom
    finally:
        stop_process(prom, 15)


def _wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.5,
              fail: bool = True):
    """Poll ``condition`` until true; on timeout fail the test (or return False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            if fail:
                pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
            return False
        time.sleep(interval_s)


async def _stream_chat(client: httpx.AsyncClient, server, urls: list[str]) -> tuple[int, bool]:
    """One streamed image chat; returns (HTTP status, saw [DONE])."""
    content = [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
               {"type": "text", "text": "Describe the image."}]
    body = {"model": server.model, "max_tokens": 12, "stream": True,
            "messages": [{"role": "user", "content": content}]}
    async with client.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as r:
        done = False
        async for line in r.aiter_lines():
            done = done or line.strip() == "data: [DONE]"
        return r.status_code, done


async def _traffic(server, images: Path) -> list[tuple[int, bool]]:
    """Streamed chats with the real photos of ../shared/images: 1 and 2 images per request."""
    manifest = json.loads((images / "MANIFEST.json").read_text())
    photos = [data_url(images / m["file"]) for m in manifest
              if m["kind"] == "real" and m["expect"] == "200" and m["file"].endswith(".png")]
    assert len(photos) >= 2, "need real PNG photos in ../shared/images"
    requests = [[u] for u in photos] + [photos[:2], photos[1:3] or photos[:2]]
    async with httpx.AsyncClient(timeout=180) as client:
        return await asyncio.gather(*(_stream_chat(client, server, urls) for urls in requests))


def _resolve_variables(prom: Prometheus, dashboard: dict, target: str) -> dict[str, str]:
    """Grafana's template variables, resolved with Prometheus' label API: job = the test's job,
    instance = the test's target (one selected value, as a user would pick it)."""
    values: dict[str, str] = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        definition = var["definition"]
        for name, value in values.items():
            definition = definition.replace(f"${name}", value)
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition)
        assert m, f"variable {var['name']}: unsupported query {definition}"
        options = prom.get(f"/api/v1/label/{m.group(2)}/values", **{"match[]": m.group(1)})
        wanted = {"job": JOB, "instance": target}[var["name"]]
        assert wanted in options, f"variable {var['name']}: {wanted} not in {options}"
        values[var["name"]] = wanted
    return values


def _substitute(expr: str, variables: dict[str, str]) -> str:
    for name, value in GRAFANA_BUILTINS.items():
        expr = expr.replace(name, value)
    for name, value in variables.items():
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in expr, f"unresolved variable in {expr}"
    return expr


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def test_dashboards_and_recording_rules_have_data_on_live_stack(server, images, prometheus):
    prom = prometheus
    target = urlparse(server.base_url).netloc
    # rate() cannot count a series' first sample: series created at their first increment
    # (vLLM's finished_reason counters, phi3v_http_responses_total codes other than the
    # pre-created ones) need one warm-up answer (as on any stack that has served before), then
    # two scrapes, so every rate() window sees the counters move.
    warm_up = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
        "model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
    assert warm_up.status_code == 200, warm_up.text
    answered = server.metric("phi3v_http_responses_total",
                             {"route": "/v1/chat/completions", "code": "200"})
    assert answered >= 1
    _wait_for(lambda: (prom.value(
        f'phi3v_http_responses_total{{job="{JOB}", route="/v1/chat/completions", code="200"}}')
        or 0) >= answered and prom.value(f'up{{job="{JOB}"}}') == 1,
        30, "a scrape of the API after the warm-up request")
    time.sleep(2.5)  # ...and two more scrapes (1 s interval)

    results = asyncio.run(_traffic(server, images))
    # A 429 (admission left busy by an earlier test of the session) only feeds the rejection
    # series; most chats must stream to the end so that every latency histogram moves.
    assert all(status in (200, 429) for status, _ in results), results
    assert sum(status == 200 and done for status, done in results) >= len(results) // 2, results

    # Prometheus has scraped the finished traffic and evaluated the rules on it.
    finished = server.metric("phi3v_finished_requests_total")
    _wait_for(lambda: (prom.value(f'phi3v_finished_requests_total{{job="{JOB}"}}') or 0)
              >= finished, 20, "a scrape after the traffic")
    # ...and evaluated the rules after it (the checks below report any rule still empty).
    records = [r["record"] for r in _recording_rules()]
    _wait_for(lambda: all(_finite(prom.query(r)) for r in records), 15,
              "every recording rule to be evaluated", fail=False)
    at = time.time()

    failures = []
    for r in _recording_rules():
        for expr in (r["record"], r["expr"]):
            result = prom.query(expr, at)
            if not result:
                failures.append(f"recording rule {r['record']}: no series for {expr}")
            elif not _finite(result):
                failures.append(f"recording rule {r['record']}: only NaN/Inf for {expr}")
    for path in DASHBOARDS:
        d = _dashboard(path)
        variables = _resolve_variables(prom, d, target)
        for title, ref, raw in _queries(d):
            expr = _substitute(raw, variables)
            result = prom.query(expr, at)
            if not result:
                failures.append(f"{d['title']} / {title} / {ref}: No data for {expr}")
            elif not _finite(result):
                failures.append(f"{d['title']} / {title} / {ref}: only NaN/Inf for {expr}")
    assert not failures, "\n".join(failures)

    # GPU utilization: absent on CPU, shown as the mapped "unavailable" value -1.
    gpu_available = httpx.get(f"{server.base_url}/admin/autotuner",
                              timeout=10).json()["gpu_utilization_available"]
    raw = prom.query(f'phi3v_gpu_utilization_ratio{{job="{JOB}"}}', at)
    panel = prom.query(f'avg(phi3v_gpu_utilization_ratio{{job="{JOB}"}}) or on() vector(-1)', at)
    if gpu_available:
        assert raw and 0 <= float(panel[0]["value"][1]) <= 1
    else:
        assert raw == [], "phi3v_gpu_utilization_ratio must be absent without a GPU"
        assert float(panel[0]["value"][1]) == -1

    # Every series the alert rules select exists on the live stack (GPU utilization only
    # where NVML reports a GPU; a tenant's budget ratio only where the keys file gives it a
    # budget, tests/engine/test_tenant_limits.py), readiness included.
    wanted = set().union(*(_metric_names(r["expr"]) for r in _alert_rules() + _recording_rules()))
    wanted -= {"phi3v_gpu_utilization_ratio", "phi3v_tenant_budget_used_ratio"}
    live = {s["metric"]["__name__"] for s in prom.query(
        f'count by (__name__) ({{__name__=~"{"|".join(sorted(wanted))}", job="{JOB}"}})', at)}
    assert wanted <= live, f"series the rules use but the stack does not export: {wanted - live}"
    assert prom.value(f'phi3v_ready{{job="{JOB}"}}') == 1

    # Every rule group loaded and evaluated without error; the availability alerts are quiet.
    groups = prom.get("/api/v1/rules")["groups"]
    loaded = {r.get("name") for g in groups for r in g["rules"]}
    expected = {r.get("alert") or r.get("record") for r in _alert_rules() + _recording_rules()}
    assert expected <= loaded, expected - loaded
    errors = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"]
              if r.get("health") == "err" or r.get("lastError")]
    assert not errors, errors
    active = {a["labels"]["alertname"] for a in prom.get("/api/v1/alerts")["alerts"]}
    assert not active & {"Phi3vTargetDown", "Phi3vTargetMissing", "Phi3vEngineNotReady",
                         "Phi3vQueueNearlyFull"}, active
