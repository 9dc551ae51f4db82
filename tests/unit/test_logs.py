"""Logs (``serve.logs``): the JSON and text formats, the request id on every record of a
request, the configuration vLLM and uvicorn are handed, and the access record the gateway
writes for each request (in-process, a stand-in for vLLM's app behind the real layers)."""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from serve import logs
from serve.app import Gateway, Phase, compose
from serve.settings import Settings
from tests.helpers import ROOT, data_url, png_bytes


def _record(msg="hello %s", args=("world",), name="serve.test", level=logging.INFO, **extra):
    record = logging.LogRecord(name, level, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def _handled(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    """``record`` through a handler with ``formatter`` and the request-id filter."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    handler.addFilter(logs.RequestIdFilter())
    handler.handle(record)
    return out.getvalue()


def test_json_is_one_object_per_line_with_the_record_s_own_fields():
    line = _handled(logs.JsonFormatter(), _record(status=200, content={"k": [1]},
                                                  color_message="x", vllm_process_name="p"))
    assert line.count("\n") == 1
    data = json.loads(line)
    assert data["message"] == "hello world" and data["level"] == "INFO"
    assert data["logger"] == "serve.test" and isinstance(data["process"], int)
    assert datetime.datetime.fromisoformat(data["time"]).utcoffset() == datetime.timedelta(0)
    assert data["status"] == 200 and data["content"] == {"k": [1]}
    assert "request_id" not in data  # logged outside a request
    assert not {"color_message", "vllm_process_name", "msg", "args"} & data.keys()


def test_json_writes_a_record_with_a_lone_surrogate():
    """Python decodes non-UTF-8 bytes (a file name) to lone surrogates, which msgspec cannot
    encode: the record is still written, one line, the surrogate escaped."""
    line = _handled(logs.JsonFormatter(), _record(path="/models/phi\udcff"))
    assert line.count("\n") == 1 and json.loads(line)["path"] == "/models/phi\udcff"


def test_json_keeps_a_traceback_on_its_line():
    try:
        raise ValueError("bad")
    except ValueError:
        record = logging.LogRecord("serve.app", logging.ERROR, __file__, 1, "failed", (),
                                   sys.exc_info())
    line = _handled(logs.JsonFormatter(), record)
    assert line.count("\n") == 1 and "ValueError: bad" in json.loads(line)["exc_info"]


def test_text_puts_the_fields_after_the_message():
    line = _handled(logs.TextFormatter(), _record(status=200, reason=None, text="two words",
                                                  content={"a": 1}))
    assert line.rstrip().endswith('serve.test: hello world status=200 text="two words" '
                                  'content={"a": 1}')


def test_every_record_of_a_request_carries_its_id_threads_included():
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(getattr(record, "request_id", None))

    log = logging.getLogger("serve.test.request_id")
    handler = Keep()
    handler.addFilter(logs.RequestIdFilter())
    log.addHandler(handler)
    log.propagate = False
    try:
        async def request():
            token = logs._REQUEST.set({"request_id": "first"})
            try:
                log.warning("on the loop")
                logs.note(request_id="final")  # the intake decides the id later
                await asyncio.to_thread(log.warning, "in a worker thread")
            finally:
                logs._REQUEST.reset(token)
            log.warning("after the request")

        asyncio.run(request())
    finally:
        log.removeHandler(handler)
    assert seen == ["first", "final", None]


@pytest.mark.parametrize(("tty", "expected"), [(True, "text"), (False, "json")])
def test_auto_is_text_on_a_terminal_and_json_otherwise(monkeypatch, tty, expected):
    monkeypatch.setattr(sys, "stderr", SimpleNamespace(isatty=lambda: tty))
    assert logs.resolved_format("auto") == expected
    assert logs.resolved_format("text") == "text" and logs.resolved_format("json") == "json"


def test_vllm_and_uvicorn_are_handed_the_same_configuration():
    """In a fresh interpreter: after ``configure_logging``, uvicorn's own configuration step
    and vLLM's (a ``dictConfig`` of the file ``VLLM_LOGGING_CONFIG_PATH`` names) leave one
    JSON stream on stderr, with uvicorn's access log off."""
    code = (
        "import json, logging, logging.config, os, uvicorn\n"
        "from serve.logs import configure_logging\n"
        "from serve.settings import Settings\n"
        "configure_logging(Settings(device='cpu', log_format='json'))\n"
        "uvicorn.Config(lambda *a: None, log_level='info')\n"
        "logging.getLogger('uvicorn.error').info('uvicorn line')\n"
        "logging.getLogger('uvicorn.access').info('uvicorn access line')\n"
        "with open(os.environ['VLLM_LOGGING_CONFIG_PATH']) as f:\n"
        "    logging.config.dictConfig(json.load(f))\n"
        "logging.getLogger('vllm.v1.engine').info('vllm line')\n"
        "logging.getLogger('serve.app').info('serve line')\n"
    )
    env_unset = ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_LEVEL")
    env = {k: v for k, v in __import__("os").environ.items() if k not in env_unset}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, env=env, check=True)
    lines = [json.loads(line) for line in run.stderr.splitlines()]
    assert [(d["logger"], d["message"]) for d in lines] == [
        ("uvicorn.error", "uvicorn line"), ("vllm.v1.engine", "vllm line"),
        ("serve.app", "serve line")]
    assert run.stdout == ""


# --- the access record, through the gateway's real layers -------------------------------------
def _usage(prompt: int, completion: int) -> SimpleNamespace:
    """What vLLM's chat handler leaves on ``request.state`` (``RequestResponseMetadata``)."""
    return SimpleNamespace(final_usage_info=SimpleNamespace(prompt_tokens=prompt,
                                                            completion_tokens=completion))


async def fake_vllm(scope, receive, send):
    """vLLM's app, as the access record sees it: usage on the request's state, then a JSON
    answer or an SSE stream."""
    body = json.loads((await receive())["body"])
    scope["state"]["request_metadata"] = _usage(11, 3)
    if body.get("stream"):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        if body["messages"][0]["content"] == "leave":  # the client leaves after one event
            await send({"type": "http.response.body", "more_body": True,
                        "body": b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'})
            assert (await receive())["type"] == "http.disconnect"
            return
        for event in (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b"data: [DONE]\n\n"):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"usage": {}}', "more_body": False})


def _gateway(**settings) -> Gateway:
    gateway = Gateway(Settings(device="cpu", autotune="static", admission_limit=1, max_queue=0,
                               engine_queue=0, **settings), registry=CollectorRegistry())
    gateway.state.openai_app = compose(fake_vllm, gateway.request_layers())
    gateway.state.phase = Phase.READY
    return gateway


async def _call(app, path: str, body: dict | None = None, headers=()) -> tuple[int, dict]:
    sent = []
    raw = json.dumps(body).encode() if body is not None else b""
    messages = iter([{"type": "http.request", "body": raw, "more_body": False}])

    async def receive():  # the body, then the client is gone
        return next(messages, {"type": "http.disconnect"})

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST" if body is not None else "GET", "path": path,
             "headers": list(headers), "query_string": b""}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"])


def _chat(text: str, **extra) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": text}],
            **extra}


@pytest.fixture
def access(caplog):
    caplog.set_level(logging.INFO, logger="serve.access")
    return lambda: [r for r in caplog.records if r.name == "serve.access"]


async def test_one_access_record_per_request_with_its_id_tokens_and_times(access):
    from PIL import Image

    gateway = _gateway()
    photo = {"type": "image_url",
             "image_url": {"url": data_url(png_bytes(Image.new("RGB", (64, 48))))}}
    asked = [
        ("/v1/chat/completions", _chat("a secret text prompt"), ()),
        ("/v1/chat/completions", _chat("streamed", stream=True), [(b"x-request-id", b"mine")]),
        ("/v1/chat/completions", {"model": "m", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what?"}, photo]}]}, ()),
        ("/v1/chat/completions", {"model": "m", "messages": "not a list"}, ()),
        ("/v1/unknown", {}, [(b"x-request-id", b"client-id")]),
        ("/health", None, ()),
    ]
    answers = [await _call(gateway, path, body, headers) for path, body, headers in asked]
    records = access()
    assert len(records) == len(asked)
    for (status, headers), record in zip(answers, records, strict=True):
        assert record.request_id == headers[b"x-request-id"].decode()
        assert record.status == status and record.e2e_s > 0
        assert not hasattr(record, "content")  # no --enable-log-requests
    text, stream, image, bad, closed, health = records
    assert text.route == "/v1/chat/completions" and text.method == "POST"
    assert (text.prompt_tokens, text.completion_tokens, text.image_tokens) == (11, 3, 0)
    assert text.queue_wait_s is not None and text.ttft_s is None  # not streamed
    assert stream.request_id.startswith("mine-") and 0 < stream.ttft_s <= stream.e2e_s
    assert image.image_tokens > 0
    assert bad.status == 400 and bad.reject_reason == "invalid_request"
    assert bad.prompt_tokens is None and bad.queue_wait_s is None
    assert (closed.status, closed.route, closed.request_id) == (404, "other", "client-id")
    assert (health.route, health.method, health.status) == ("/health", "GET", 200)


async def test_an_admission_refusal_names_its_reason(access):
    gateway = _gateway()
    held = await gateway.admission.limiter.acquire()  # the one slot (limit 1, no queue)
    try:
        status, headers = await _call(gateway, "/v1/chat/completions", _chat("hi"))
    finally:
        held.release(completed=False)
    (record,) = access()
    assert status == 429 and record.status == 429
    assert record.reject_reason == headers[b"x-phi3v-reject-reason"].decode() == "queue_full"
    assert record.request_id == headers[b"x-request-id"].decode()


async def test_the_content_is_logged_only_when_asked(access):
    from PIL import Image

    gateway = _gateway(enable_log_requests=True)
    png = png_bytes(Image.new("RGB", (32, 16)))
    await _call(gateway, "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "describe"},
                                     {"type": "image_url", "image_url": {"url": data_url(png)}}]}]})
    (record,) = access()
    import hashlib

    assert record.content["messages"] == [{"role": "user", "text": "describe"}]
    (image,) = record.content["images"]
    assert image["bytes"] == len(png) and image["sha256"] == hashlib.sha256(png).hexdigest()
    assert "base64" not in json.dumps(record.content)


async def test_a_stream_the_client_left_is_logged_when_it_ends(access):
    gateway = _gateway()
    status, _ = await _call(gateway, "/v1/chat/completions", _chat("leave", stream=True))
    (record,) = access()
    assert status == record.status == 200 and record.client_left
    assert 0 < record.ttft_s <= record.e2e_s


async def test_vllm_s_access_log_flags_apply_to_the_access_record(access):
    gateway = _gateway(vllm_args={"disable_access_log_for_endpoints": "/health, /ready"})
    status, headers = await _call(gateway, "/health")
    assert status == 200 and headers[b"x-request-id"]  # an id, but no record
    await _call(gateway, "/limits")
    assert [r.route for r in access()] == ["/limits"]
    await _call(_gateway(vllm_args={"disable_uvicorn_access_log": True}), "/limits")
    assert len(access()) == 1
