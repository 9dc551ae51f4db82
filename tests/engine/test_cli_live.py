"""A real server started the way an operator of ``vllm serve`` would (a ``--config`` YAML
of vLLM and gateway flags, vLLM flags on the command line, a ``PHI3V_*`` variable), and
stopped the way a supervisor does: SIGTERM. With nothing running, the drain
(``serve.lifecycle``) has nothing to wait for. The drain of running requests, and a lost
engine, are ``test_lifecycle``'s."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx

from tests.helpers import start_server, stop_server


def test_config_file_vllm_flags_and_environment_reach_the_running_server(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 6\nmax-queue: 3\nkv-cache-dtype: auto\n"
                      "served-model-name: [phi3v, phi3v-alias]\n"
                      "enable-prefix-caching: false\n")
    srv = start_server(["--config", str(config), "--max-queue", "5",
                        "--disable-uvicorn-access-log", "--drain-timeout-s", "30"],
                       env={"PHI3V_MAX_QUEUE_WAIT_S": "7"}, name="cli-config")
    try:
        models = httpx.get(f"{srv.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]][0] == "phi3v"
        # A second served name is an alias vLLM accepts; answers carry the first.
        answer = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": "phi3v-alias", "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "phi3v"
        scrape = srv.metrics()
        assert srv.metric("phi3v_max_num_seqs_ceiling", scrape=scrape) == 6  # config file
        assert srv.metric("phi3v_max_queue", scrape=scrape) == 5  # command line over config
        log = srv.log_path.read_text()
        # Not a terminal: the log is JSON lines (--log-format auto).
        (message,) = [json.loads(ln)["message"] for ln in log.splitlines()
                      if ln.startswith("{") and "engine config:" in ln]
        engine = json.loads(message.split("engine config:", 1)[1])
        assert engine["max_num_seqs"] == "6" and engine["enable_prefix_caching"] == "False"
        # --disable-uvicorn-access-log: no access record either.
        records = [json.loads(ln) for ln in log.splitlines() if ln.startswith("{")]
        assert records and not [r for r in records if r.get("logger") == "serve.access"]

        # A quiet server stops at once on SIGTERM: exit 0, not the drain's grace (30 s).
        t0 = time.monotonic()
        os.kill(srv.proc.pid, signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log_tail()
        assert time.monotonic() - t0 < 15
        assert "drained: no request running" in srv.log_tail(200)
    finally:
        stop_server(srv)
