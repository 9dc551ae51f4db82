"""Replicas behind vllm-router, without an engine: the router's flags (``deploy/replicas.py``)
are flags of the installed router and reach every place that runs it (the demo, the
Kubernetes Deployment), its Prometheus config scrapes every replica and the router, and the UI
sends what the router keys on. The live behaviour is ``tests/engine/test_replicas.py``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib

import httpx
import pytest
import yaml

from deploy.replicas import (
    ROUTER_FLAGS,
    ROUTER_METRICS_PORT,
    SESSION_HEADER,
    replica_ports,
    router_command,
    router_flag_args,
)
from tests.helpers import ROOT
from ui.api import SESSION_HEADER as UI_SESSION_HEADER
from ui.api import ApiClient
from ui.errors import ApiError
from ui.settings import UISettings

DEPLOY = ROOT / "deploy"


def router_parse(args: list[str]):
    """``args`` read by the installed vllm-router's own parser (as ``vllm-router`` does)."""
    from vllm_router.launch_router import parse_router_args

    return parse_router_args(args)


def docs(path):
    return {(d["kind"], d["metadata"]["name"]): d
            for d in yaml.safe_load_all(path.read_text()) if d}


def test_router_flags_are_the_installed_routers_and_take_effect():
    parsed = router_parse(router_flag_args())
    for flag in ROUTER_FLAGS:
        value = getattr(parsed, flag.name[2:].replace("-", "_"))
        assert value == flag.value or str(value) == flag.value or value == [flag.value], flag
    assert parsed.policy == "consistent_hash" and parsed.health_check_endpoint == "/ready"
    with pytest.raises(SystemExit):  # not vacuous: a flag the router lacks is refused
        router_parse(["--health-check-path", "/ready"])
    assert all(f.why for f in ROUTER_FLAGS)


def test_the_router_checks_our_readiness_probe_and_sends_our_request_id_header():
    """The router's health check is the path Kubernetes' readiness probe uses (503 while
    draining or without an engine), and it takes the request id from the one header our
    gateway reads."""
    from serve.logs import REQUEST_ID_HEADER

    api = docs(DEPLOY / "k8s" / "api.yaml")["Deployment", "phi3v-api"]
    (c,) = api["spec"]["template"]["spec"]["containers"]
    values = {f.name: f.value for f in ROUTER_FLAGS}
    assert values["--health-check-endpoint"] == c["readinessProbe"]["httpGet"]["path"]
    assert values["--request-id-headers"].encode() == REQUEST_ID_HEADER
    assert SESSION_HEADER == UI_SESSION_HEADER == "X-Session-ID"


def test_router_command_overrides_replace_a_flag():
    cmd = router_command(8000, ["http://127.0.0.1:8001"], 29000,
                         overrides={"--health-check-interval-secs": "600"})
    parsed = router_parse(cmd[1:])
    assert parsed.health_check_interval_secs == 600
    assert parsed.worker_urls == ["http://127.0.0.1:8001"] and parsed.port == 8000
    assert cmd.count("--health-check-interval-secs") == 1


def test_k8s_router_runs_the_same_flags_and_discovers_the_api_pods():
    router = docs(DEPLOY / "k8s" / "router.yaml")
    api = docs(DEPLOY / "k8s" / "api.yaml")
    deployment = router["Deployment", "phi3v-router"]
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    # Every flag of ROUTER_FLAGS, in order, after the deployment's own (address, discovery,
    # metrics); all of them flags of the router.
    assert args[-2 * len(ROUTER_FLAGS):] == router_flag_args()
    parsed = router_parse([a.replace("$(POD_NAMESPACE)", "phi3v") for a in args])
    assert parsed.service_discovery and parsed.service_discovery_namespace == "phi3v"
    # Discovery finds the API pods on their port, in the pod's own namespace.
    api_pod = api["Deployment", "phi3v-api"]["spec"]["template"]
    assert parsed.selector.items() <= api_pod["metadata"]["labels"].items()
    (api_port,) = api_pod["spec"]["containers"][0]["ports"]
    assert parsed.service_discovery_port == api_port["containerPort"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # Its RBAC: read pods, bound to the account the pods run as.
    account = pod["serviceAccountName"]
    assert ("ServiceAccount", account) in router and pod["automountServiceAccountToken"]
    role = router["Role", "phi3v-router"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    binding = router["RoleBinding", "phi3v-router"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert [s["name"] for s in binding["subjects"]] == [account]
    # Ports: the Service and the PodMonitor name the container's.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": int(args[args.index("--port") + 1]),
                     "metrics": int(args[args.index("--prometheus-port") + 1])}
    assert router["Service", "phi3v-router"]["spec"]["ports"][0]["targetPort"] == "http"
    monitor = router["PodMonitor", "phi3v-router"]["spec"]["podMetricsEndpoints"][0]
    assert monitor["port"] == "metrics"
    assert {"targetLabel": "job", "replacement": "vllm-router"} in monitor["relabelings"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert c["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"][
        "runAsNonRoot"]


def test_the_router_image_pins_the_tested_router():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (pin,) = extras["router"]
    assert pin.startswith("vllm-router==")
    assert f"pip install --no-cache-dir {pin}" in (DEPLOY / "Dockerfile.router").read_text()
    from importlib.metadata import version

    assert pin == f"vllm-router=={version('vllm-router')}"


def test_prometheus_scrapes_every_replica_and_the_router():
    """The demo's layout (the Makefile's defaults, deploy/replicas.py's ports) is what
    prometheus-replicas.yml scrapes; the gateways keep the job name the alert rules select."""
    make = (ROOT / "Makefile").read_text()

    def default(name):
        return int(re.search(rf"^{name} \?= (\d+)$", make, flags=re.M).group(1))

    config = yaml.safe_load(
        (ROOT / "monitoring" / "prometheus" / "prometheus-replicas.yml").read_text())
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in config["scrape_configs"]}
    port, replicas = default("PORT"), default("REPLICAS")
    assert jobs["phi3v"] == [f"127.0.0.1:{p}" for p in replica_ports(port, replicas)]
    assert jobs["vllm-router"] == [f"127.0.0.1:{default('ROUTER_METRICS_PORT')}"]
    assert default("ROUTER_METRICS_PORT") == ROUTER_METRICS_PORT
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool missing: make system-deps")
    done = subprocess.run([promtool, "check", "config", "--syntax-only",
                           str(ROOT / "monitoring" / "prometheus" / "prometheus-replicas.yml")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# --- the UI behind the router -------------------------------------------------------------
LIMITS_JSON = {"model": "m", "max_images_per_request": 4, "max_image_bytes": 1,
               "max_image_pixels": 1, "image_formats": ["PNG"], "max_model_len": 8192,
               "num_crops": 4, "max_num_crops": 16}


async def test_ui_sends_its_conversation_and_a_request_id_with_each_turn():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, text="data: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})

    client = ApiClient(UISettings(api_base_url="http://router.test"),
                       transport=httpx.MockTransport(handler))
    for _ in range(2):
        [e async for e in client.stream_chat({"model": "m", "messages": []},
                                             conversation="thread-1")]
    [e async for e in client.stream_chat({"model": "m", "messages": []})]
    await client.aclose()
    assert [h.get(SESSION_HEADER) for h in seen] == ["thread-1", "thread-1", None]
    ids = [h["x-request-id"] for h in seen]
    assert len(set(ids)) == 3 and all(i.startswith("ui-") for i in ids)


async def test_ui_reads_limits_from_the_first_replica_that_answers():
    """Behind a router GET /limits is asked of ``limits_urls`` in order; without them, of the
    API base URL."""
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        if request.url.host == "replica-1.test":
            raise httpx.ConnectError("down")
        if request.url.host == "router.test":
            return httpx.Response(404, text="Not Found")
        return httpx.Response(200, json=LIMITS_JSON)

    settings = UISettings(api_base_url="http://router.test",
                          limits_urls=["http://replica-1.test", "http://replica-2.test/"])
    client = ApiClient(settings, transport=httpx.MockTransport(handler))
    assert (await client.limits()).num_crops == 4
    assert asked == ["http://replica-1.test/limits", "http://replica-2.test/limits"]
    await client.aclose()
    env = json.loads(settings.env()["PHI3V_UI_LIMITS_URLS"])  # handed on to the Chainlit app
    assert env == settings.limits_urls
    plain = ApiClient(UISettings(api_base_url="http://router.test"),
                      transport=httpx.MockTransport(handler))
    with pytest.raises(ApiError):  # the router's 404: nothing else to ask
        await plain.limits()
    await plain.aclose()
