"""Monitoring (``monitoring/``): Prometheus config and rules, Grafana dashboards, proven live.

- ``promtool check config`` / ``check rules`` / ``test rules`` (unit tests that fire AND clear
  every alert). Debian's ``prometheus`` package provides ``promtool`` and ``prometheus``; these
  tests fail, never skip, without them.
- Dashboard JSON structure: unique panel ids, templated datasource everywhere, units, grid.
- End to end: a real Prometheus (``/usr/bin/prometheus``) scrapes the session's API server
  while streamed image chats flow; every dashboard panel query (template variables resolved as
  Grafana would) and every recording rule must return data.

GPU utilization on CPU: the stack exports ``phi3v_gpu_utilization_ratio`` only where NVML
reports a GPU (a fake 0 would read as "idle GPU"). The dashboards query it as
``avg(phi3v_gpu_utilization_ratio{...}) or on() vector(-1)`` with a value mapping
-1 -> "unavailable (no GPU / NVML)": the panel shows a clear state instead of "No data", so it
needs no exception here; the end-to-end test asserts that on CPU the raw series is absent and
the panel's value is exactly that -1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT

MONITORING = ROOT / "monitoring"
PROM_DIR = MONITORING / "prometheus"
PROMETHEUS_YML = PROM_DIR / "prometheus.yml"
RULE_FILES = sorted((PROM_DIR / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))
GRAFANA = MONITORING / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
JOB = "phi3v"
DS_REF = {"type": "prometheus", "uid": "${datasource}"}
#: Metric names vLLM V1 removed; dashboards and rules must use the current ones.
REMOVED_VLLM_METRICS = ("vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc",
                        "vllm:time_per_output_token_seconds", "vllm:num_requests_swapped",
                        "vllm:gpu_prefix_cache_hit_rate")
#: What the test substitutes for Grafana's built-in interval variables.
GRAFANA_BUILTINS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}


def _binary(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK)
                                  else None)
    if path is None:
        pytest.fail(f"`{name}` not found: install Debian's prometheus package "
                    "(apt-get install -y --no-install-recommends prometheus)", pytrace=False)
    return path


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def _alert_rules() -> list[dict]:
    return [r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]
            for r in g["rules"] if "alert" in r]


def _recording_rules() -> list[dict]:
    return [r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]
            for r in g["rules"] if "record" in r]


def _dashboard(path: Path) -> dict:
    return json.loads(path.read_text())


def _panels(panels: list[dict]):
    """Every panel, rows' nested (collapsed) panels included."""
    for p in panels:
        yield p
        yield from _panels(p.get("panels") or [])


def _queries(dashboard: dict):
    """(panel title, refId, expr) of every panel target."""
    for p in _panels(dashboard["panels"]):
        for t in p.get("targets") or []:
            yield p["title"], t.get("refId"), t["expr"]


# --- promtool -----------------------------------------------------------------------------------
def test_promtool_check_config():
    res = _run(_binary("promtool"), "check", "config", str(PROMETHEUS_YML))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(RULE_FILES)} rule files found" in res.stdout + res.stderr


def test_promtool_check_rules():
    assert RULE_FILES, "no rule files"
    res = _run(_binary("promtool"), "check", "rules", *map(str, RULE_FILES))
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_rule_unit_tests():
    assert RULE_TESTS, "no promtool unit tests"
    res = _run(_binary("promtool"), "test", "rules", *map(str, RULE_TESTS))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAILED" not in res.stdout + res.stderr


def _duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text))


def test_every_alert_fires_and_clears_in_unit_tests():
    """Each alert has a promtool case where it fires, then a later check where it is gone."""
    covered: dict[str, set[str]] = {}
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            checks = case.get("alert_rule_test") or []
            for fire in checks:
                if not fire.get("exp_alerts"):
                    continue
                kinds = covered.setdefault(fire["alertname"], set())
                kinds.add("fires")
                if any(c["alertname"] == fire["alertname"] and not c.get("exp_alerts")
                       and _duration_s(c["eval_time"]) > _duration_s(fire["eval_time"])
                       for c in checks):
                    kinds.add("clears")
    for rule in _alert_rules():
        assert covered.get(rule["alert"]) == {"fires", "clears"}, (
            f"{rule['alert']}: no promtool case that fires and then clears it "
            f"(found {sorted(covered.get(rule['alert'], ()))})")


def test_alert_rules_carry_severity_and_runbook():
    alerts = _alert_rules()
    required = {"TargetDown", "EngineNotReady", "QueueGrowing", "QueueNearlyFull",
                "TTFTP90OverTarget", "KVCacheHigh", "Preemptions", "High5xxRatio",
                "HighRejectionRatio", "AutotunerPinnedAtFloor", "AutotunerPinnedAtCeiling"}
    assert required <= {a["alert"].removeprefix("Phi3v") for a in alerts}
    for a in alerts:
        assert a["labels"].get("severity") in {"critical", "warning"}, a["alert"]
        for key in ("summary", "description", "runbook"):
            assert len(a["annotations"].get(key, "")) > 20, f"{a['alert']}: {key} missing"


def test_recording_rules_cover_latency_percentiles_rates_and_goodput():
    records = {r["record"] for r in _recording_rules()}
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                   "e2e_request_latency_seconds"):
        for p in ("p50", "p90", "p99"):
            assert f"instance:vllm_{metric}:{p}_rate5m" in records
    assert {"instance:phi3v_requests:rate5m", "instance:vllm_prompt_tokens:rate5m",
            "instance:vllm_generation_tokens:rate5m", "instance:phi3v_goodput:ratio_rate5m",
            "instance:phi3v_rejected_requests:ratio_rate5m",
            "instance:phi3v_http_responses_5xx:ratio_rate5m",
            "instance_code:phi3v_http_responses:rate5m"} <= records


def _metric_names(expr: str) -> set[str]:
    """The phi3v_* and vllm:* series names an expression selects (recording-rule names such
    as ``instance:phi3v_...`` excluded)."""
    return set(re.findall(r"(?<![\w:])(?:phi3v_\w+|vllm:[\w:]+)", expr))


def test_rules_and_dashboards_use_the_gateway_series():
    """Arrivals, ratios, readiness and autotuner bounds come from the series the gateway
    exports for them, not from stand-ins or hard-coded defaults."""
    by_name = {r.get("alert") or r["record"]: r["expr"] for r in _alert_rules()
               + _recording_rules()}
    assert "phi3v_requests_total" in by_name["instance:phi3v_requests:rate5m"]
    assert "phi3v_requests_total" in by_name["instance:phi3v_rejected_requests:ratio_rate5m"]
    assert "phi3v_http_responses_total" in by_name["instance:phi3v_http_responses_5xx:ratio_rate5m"]
    assert "phi3v_ready" in by_name["Phi3vEngineNotReady"]
    assert "phi3v_autotuner_min_seqs" in by_name["Phi3vAutotunerPinnedAtFloor"]
    assert {"phi3v_pending_requests", "phi3v_max_queue"} <= _metric_names(
        by_name["Phi3vQueueNearlyFull"])
    # Queue depth is the whole queue (gateway + engine): vLLM's gauge alone misses the gateway.
    assert _metric_names(by_name["Phi3vQueueGrowing"]) == {"phi3v_queued_requests"}
    exprs = list(by_name.values()) + [e for p in DASHBOARDS for _, _, e in _queries(_dashboard(p))]
    for expr in exprs:
        # vLLM's instrumentator (http_requests_total) does not see the gateway's own answers;
        # phi3v_request_images_count is an image histogram, not the arrival counter.
        assert not re.search(r"(?<![\w:])http_requests_total", expr), expr
        assert "phi3v_request_images_count" not in expr or "phi3v_request_images_sum" in expr, expr

    autotuner = _dashboard(GRAFANA / "dashboards/phi3v-autotuner.json")
    names = set().union(*(_metric_names(e) for _, _, e in _queries(autotuner)))
    assert {"phi3v_autotuner_min_seqs", "phi3v_autotuner_headroom_ratio",
            "phi3v_autotuner_kv_high_ratio", "phi3v_autotuner_gpu_busy_ratio"} <= names
    for title, ref, expr in _queries(autotuner):
        assert not re.search(r"(?<![\w.])0\.\d+\s*\*", expr), f"{title}/{ref}: fixed factor"
    for p in _panels(autotuner["panels"]):
        steps = (p.get("fieldConfig", {}).get("defaults", {}).get("thresholds") or {}).get(
            "steps", [])
        assert not {s["value"] for s in steps} & {0.7, 0.95, 0.98}, (
            f"{p['title']}: hard-coded autotuner threshold {steps}")
    gpu = next(p for p in _panels(autotuner["panels"]) if p["title"] == "GPU utilization")
    [config] = [t for t in gpu.get("transformations", []) if t["id"] == "configFromData"]
    busy = next(t for t in gpu["targets"] if "phi3v_autotuner_gpu_busy_ratio" in t["expr"])
    assert config["options"]["configRefId"] == busy["refId"]
    assert config["options"]["mappings"][0]["fieldName"] == busy["legendFormat"]


def test_no_removed_vllm_metric_names():
    exprs = [r["expr"] for r in _alert_rules() + _recording_rules()]
    exprs += [e for p in DASHBOARDS for _, _, e in _queries(_dashboard(p))]
    for expr in exprs:
        for name in REMOVED_VLLM_METRICS:
            assert not re.search(re.escape(name) + r"(?![a-z_])", expr), (
                f"removed vLLM metric {name} in {expr}")


# --- Grafana ------------------------------------------------------------------------------------
def test_grafana_provisioning():
    ds = yaml.safe_load((GRAFANA / "provisioning/datasources/phi3v.yml").read_text())
    assert ds["apiVersion"] == 1
    [source] = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
    job = next(j for j in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
               if j["job_name"] == JOB)
    assert source["jsonData"]["timeInterval"] == job["scrape_interval"]
    prov = yaml.safe_load((GRAFANA / "provisioning/dashboards/phi3v.yml").read_text())
    assert prov["apiVersion"] == 1
    [provider] = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_dashboards_are_distinct():
    assert {p.stem for p in DASHBOARDS} == {"phi3v-serving-overview", "phi3v-autotuner"}
    uids = [_dashboard(p)["uid"] for p in DASHBOARDS]
    assert len(set(uids)) == len(uids)


def _overlap(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_structure(path):
    d = _dashboard(path)
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == DS_REF
        assert "label_values(" in variables[name]["definition"]

    panels = list(_panels(d["panels"]))
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids), ids
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("x", "y", "w", "h")), p["title"]
        assert g["x"] >= 0 and g["y"] >= 0 and 1 <= g["w"] <= 24 and g["h"] >= 1, p["title"]
        assert g["x"] + g["w"] <= 24, f"{p['title']}: wider than the 24-column grid"
    for a, b in ((a, b) for i, a in enumerate(panels) for b in panels[i + 1:]):
        assert not _overlap(a["gridPos"], b["gridPos"]), f"{a['title']} overlaps {b['title']}"

    data_panels = [p for p in panels if p["type"] != "row"]
    assert data_panels
    for p in data_panels:
        title = p["title"]
        assert p["datasource"] == DS_REF, f"{title}: datasource is not ${{datasource}}"
        assert p.get("description"), f"{title}: no description"
        targets = p.get("targets") or []
        assert targets, f"{title}: no query"
        assert len({t["refId"] for t in targets}) == len(targets), f"{title}: duplicate refId"
        for t in targets:
            assert t.get("datasource") == DS_REF, f"{title}/{t['refId']}: datasource"
            expr = t["expr"]
            # Every selector filters on the job and instance variables.
            for selector in re.findall(r"\{[^}]*\}", expr.replace("{{", "").replace("}}", "")):
                assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector, (
                    f"{title}/{t['refId']}: selector {selector} ignores $job/$instance")
        if p["type"] in ("timeseries", "stat"):
            unit = p["fieldConfig"]["defaults"].get("unit")
            assert isinstance(unit, str) and unit, f"{title}: no unit"


# --- the phi3v_* series: one declaration, one table --------------------------------------------
def _readme_series() -> dict[str, str]:
    """``{series name: type}`` from the table in monitoring/README.md (labels stripped)."""
    text = (MONITORING / "README.md").read_text()
    rows = re.findall(r"^\| `(phi3v_[a-z_]+)(?:\{[^}]*\})?` \| (\w+) \|", text, re.M)
    return dict(rows)


def test_series_table_equals_what_the_code_registers():
    from serve.metrics import Metrics

    metrics = Metrics()
    metrics.set_gpu_utilization(0.5)  # the one series registered lazily (where NVML sees a GPU)
    registered = {m.name + ("_total" if m.type == "counter" else ""): m.type
                  for m in metrics.registry.collect()}
    assert registered == _readme_series()
    assert sorted(registered) == metrics.names()


def test_metrics_are_per_registry_and_the_simulator_touches_no_global_one():
    code = (
        "import prometheus_client\n"
        "from serve.metrics import Metrics\n"
        "from bench.sim import simulate\n"
        "from bench.trace import phase_trace\n"
        "a, b = Metrics(), Metrics()\n"  # two at once: nothing is process-global
        "a.requests.inc()\n"
        "assert b.requests._value.get() == 0\n"
        "run = simulate(phase_trace(seed=3, phase_s=10), 'auto')\n"
        "names = [m.name for m in prometheus_client.REGISTRY.collect()]\n"
        "print(len(run.requests), sum(n.startswith('phi3v') for n in names))\n")
    out = _run(sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    results, global_series = map(int, out.stdout.split())
    assert results > 0 and global_series == 0


def test_image_cache_series_read_the_intakes_cache_at_scrape():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from serve.intake.cache import ImageCache
    from serve.intake.images import PreparedImage
    from serve.metrics import Metrics

    def scrape(metrics: Metrics) -> dict:
        text = generate_latest(metrics.registry).decode()
        return {(s.name, s.labels.get("result")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("phi3v_image_cache")}

    metrics = Metrics()
    unbound = scrape(metrics)  # before the app binds its cache: the series exist, at 0
    assert unbound == {("phi3v_image_cache_lookups_total", "hit"): 0,
                       ("phi3v_image_cache_lookups_total", "miss"): 0,
                       ("phi3v_image_cache_bytes", None): 0}
    cache = ImageCache(2**20)
    metrics.image_cache.cache = cache
    image = PreparedImage("data:image/png;base64,AAAA", 1, 1, "PNG", "passthrough")
    assert cache.get((b"k", 1)) is None  # a first sight: miss
    cache.put((b"k", 1), image)
    assert cache.get((b"k", 1)) is image  # the same image re-sent: hit
    assert cache.get((b"k", 1)) is image
    assert scrape(metrics) == {("phi3v_image_cache_lookups_total", "hit"): 2,
                               ("phi3v_image_cache_lookups_total", "miss"): 1,
                               ("phi3v_image_cache_bytes", None): image.nbytes}
