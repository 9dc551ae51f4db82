"""JSON logs of a real server (``--log-format json``, ``serve.logs``): every line of its output
is one JSON object, each request has one access record under the id its ``X-Request-Id``
header gave the client, and no record holds prompt content unless ``--enable-log-requests``
asks for it. The servers are the session's ``gateway`` (JSON logs) and ``verbose_server``
(JSON logs with prompts), shared with other tests: records are found by request id."""

from __future__ import annotations

import json

import httpx

from tests.helpers import data_url, log_lines

#: Text no server writes unless it logs prompts.
SECRET = "quartz-zebra-47 marmalade"
def access_records(lines: list[dict]) -> dict[str, dict]:
    """The access records of the generation route, by request id (one each)."""
    records = [r for r in lines if r["logger"] == "serve.access"
               and r["route"] == "/v1/chat/completions"]
    by_id = {r["request_id"]: r for r in records}
    assert len(by_id) == len(records), "two access records for one request id"
    return by_id


def chat(server, content, **extra) -> dict:
    return {"model": server.model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": content}], **extra}


def test_json_logs_one_access_record_per_request_and_no_prompt(gateway, images):
    srv = gateway.server
    url = f"{srv.base_url}/v1/chat/completions"
    answers = {}
    with httpx.Client(timeout=120, headers=gateway.auth) as client:
        answers["text"] = client.post(url, json=chat(srv, f"Say {SECRET}."))
        with client.stream("POST", url, json=chat(srv, f"Tell {SECRET}.", stream=True)) as r:
            r.read()
            answers["stream"] = r
        photo = data_url(images / "chelsea.png")
        answers["image"] = client.post(url, json=chat(srv, [
            {"type": "text", "text": f"What is this? {SECRET}"},
            {"type": "image_url", "image_url": {"url": photo}}]))
        answers["refused"] = client.post(url, json=chat(srv, SECRET, max_tokens=0))
    lines = log_lines(srv, [a.headers["x-request-id"] for a in answers.values()])

    assert [a.status_code for a in answers.values()] == [200, 200, 200, 400]
    records = access_records(lines)
    for name, answer in answers.items():
        record = records[answer.headers["x-request-id"]]
        assert record["status"] == answer.status_code and record["method"] == "POST", name
        assert record["level"] == "INFO" and record["e2e_s"] > 0, name
        if name != "refused":
            assert record["prompt_tokens"] > 0 and record["completion_tokens"] > 0, name
            assert record["queue_wait_s"] is not None and record["reject_reason"] is None, name
    stream, text = (records[answers[k].headers["x-request-id"]] for k in ("stream", "text"))
    assert 0 < stream["ttft_s"] <= stream["e2e_s"] and text["ttft_s"] is None
    image = records[answers["image"].headers["x-request-id"]]
    assert image["image_tokens"] > 0 and text["image_tokens"] == 0
    assert image["prompt_tokens"] > image["image_tokens"]
    refused = records[answers["refused"].headers["x-request-id"]]
    assert refused["reject_reason"] == "invalid_request" and refused["prompt_tokens"] is None
    # The boot's lines are JSON too (vLLM's, uvicorn's, ours), and no line holds the prompt.
    loggers = {r["logger"].split(".")[0] for r in lines}
    assert {"serve", "vllm", "uvicorn"} <= loggers, loggers
    assert not [r for r in lines if SECRET in json.dumps(r)]
    assert not [r for r in lines if r["logger"] == "uvicorn.access"]  # ours replaces it


def test_enable_log_requests_puts_the_prompt_in_the_access_record(verbose_server):
    srv = verbose_server
    answer = httpx.post(f"{srv.base_url}/v1/chat/completions",
                        json=chat(srv, f"Say {SECRET}."), timeout=120)
    assert answer.status_code == 200
    request_id = answer.headers["x-request-id"]
    lines = log_lines(srv, [request_id])
    record = access_records(lines)[request_id]
    assert record["content"]["messages"] == [{"role": "user", "text": f"Say {SECRET}."}]
    # vLLM's own request log (its --enable-log-requests) carries the same request id.
    vllm_lines = [r for r in lines if r["logger"].startswith("vllm") and
                  request_id in r["message"]]
    assert vllm_lines and all(r.get("request_id") == request_id for r in vllm_lines)
