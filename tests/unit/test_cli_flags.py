"""``python -m serve`` accepts every ``vllm serve`` flag with vLLM's meaning (serve.cli).

The first test enumerates vLLM's parser at run time, as ``test_routes`` does for vLLM's
routes: a flag a new vLLM release adds must be classified before it is silently mishandled.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from serve.cli import (  # noqa: E402
    VLLM_FLAG_POLICY,
    CliError,
    check_environment,
    gateway_fields,
    parse_settings,
    shared_fields,
)
from serve.engine import build_engine_args, vllm_frontend_args  # noqa: E402
from tests.helpers import TINY_MODEL, serve_cli  # noqa: E402


def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def test_every_vllm_flag_is_passed_on_or_classified():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import BaseFrontendArgs, FrontendArgs

    dests = {a.dest for a in vllm_parser()._actions} - {"help"}
    engine = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    app = {f.name for f in dataclasses.fields(BaseFrontendArgs)}
    server = {f.name for f in dataclasses.fields(FrontendArgs)} - app
    shared = shared_fields(dests)
    unknown = dests - engine - app - set(VLLM_FLAG_POLICY) - shared
    assert not unknown, f"vLLM flags neither passed on nor classified: {sorted(unknown)}"
    # Flags of vLLM's HTTP server (not its app, not its engine) run in *our* server: each
    # needs a decision.
    undecided = server - set(VLLM_FLAG_POLICY) - shared
    assert not undecided, f"vLLM server flags without a policy: {sorted(undecided)}"
    assert set(VLLM_FLAG_POLICY) <= dests, "policy for flags vLLM no longer has"
    assert {kind for kind, _ in VLLM_FLAG_POLICY.values()} <= {
        "mapped", "server", "app", "ours", "refused"}
    # Our flags never shadow one of vLLM's.
    assert not set(gateway_fields(dests)) & dests


def test_engine_and_frontend_flags_reach_vllm_with_their_meaning():
    s = parse_settings(["--quantization", "fp8", "--kv-cache-dtype", "fp8",
                        "--chat-template", "tpl.jinja", "--max-num-seqs", "40",
                        "--max-model-len", "4k", "--enable-log-requests",
                        "--otlp-traces-endpoint", "http://127.0.0.1:4317",
                        "--block-size", "32", "--response-role", "bot"], environ={})
    engine = build_engine_args(s)
    assert (engine.quantization, engine.kv_cache_dtype, engine.block_size) == ("fp8", "fp8", 32)
    assert (engine.max_num_seqs, engine.max_model_len) == (40, 4000)  # vLLM: k = 1000
    assert engine.enable_log_requests and s.enable_log_requests
    assert engine.otlp_traces_endpoint == s.otlp_traces_endpoint == "http://127.0.0.1:4317"
    frontend = vllm_frontend_args(s)
    assert (frontend.chat_template, frontend.response_role) == ("tpl.jinja", "bot")


def test_hardware_defaults_apply_only_where_nothing_was_set():
    cpu = ["--device", "cpu"]
    default = build_engine_args(parse_settings(cpu, environ={}))
    assert (default.dtype, default.enforce_eager) == ("float32", True)
    assert default.mm_processor_kwargs == {"num_crops": 1}
    # A value equal to vLLM's default is still a choice the operator made.
    chosen = build_engine_args(parse_settings(
        [*cpu, "--dtype", "auto", "--no-enforce-eager",
         "--mm-processor-kwargs", '{"num_crops": 4, "other": 1}'], environ={}))
    assert (chosen.dtype, chosen.enforce_eager) == ("auto", False)
    assert chosen.mm_processor_kwargs == {"num_crops": 4, "other": 1}


def test_mapped_flags_fill_our_settings():
    s = parse_settings(["--api-keys", '["k1"]', "--api-key", "k2", "k3",
                        "--limit-mm-per-prompt", '{"image": 2}',
                        "--h11-max-incomplete-event-size", "8192",
                        "--h11-max-header-count", "50", "--log-level", "WARNING",
                        "--served-model-name", "phi", "alias", "--device", "cpu",
                        "--kv-cache-memory-bytes", "123456789",
                        "--allowed-origins", '["https://app.example"]'], environ={})
    assert s.api_keys == ["k1", "k2", "k3"]
    assert s.max_images_per_prompt == 2 and s.engine_kwargs()["limit_mm_per_prompt"] == {
        "image": 2}
    assert (s.max_header_bytes, s.max_header_count, s.log_level) == (8192, 50, "warning")
    assert s.model_name == "phi" and s.engine_kwargs()["served_model_name"] == ["phi", "alias"]
    assert s.cpu_kv_cache_bytes == 123456789
    assert s.allowed_origins == ["https://app.example"]
    frontend = vllm_frontend_args(s)
    # The gateway checks keys and answers CORS itself: vLLM's app does neither.
    assert frontend.api_key is None and frontend.allowed_origins == []


def test_config_file_holds_vllm_and_gateway_flags_below_the_command_line(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text("max-num-seqs: 12\nquantization: fp8\nmax-queue: 7\n"
                      "image-url-allowlist: [a.example, b.example]\nenforce-eager: false\n")
    env = {"PHI3V_MAX_QUEUE": "3", "PHI3V_MAX_QUEUE_WAIT_S": "5"}
    s = parse_settings(["--config", str(config), "--max-num-seqs", "9"], environ=env)
    # command line > config file > environment > defaults
    assert s.max_num_seqs == 9 and s.vllm_args["quantization"] == "fp8"
    assert s.image_url_allowlist == ["a.example", "b.example"] and s.enforce_eager is False
    import os
    os.environ.update(env)
    try:
        s = parse_settings(["--config", str(config)], environ=env)
        assert s.max_queue == 7 and s.max_queue_wait_s == 5
    finally:
        for key in env:
            os.environ.pop(key)


def test_unknown_environment_variable_names_the_nearest_setting():
    with pytest.raises(CliError, match="PHI3V_MAX_QUEU .*did you mean PHI3V_MAX_QUEUE\\?"):
        check_environment({"PHI3V_MAX_QUEU": "3"})
    # The chat UI's, the tests' and the clients' variables are not the server's business.
    check_environment({"PHI3V_UI_API_KEY": "k", "PHI3V_API_KEY": "k", "PHI3V_TEST_X": "1",
                       "PHI3V_MAX_QUEUE": "3", "PATH": "/bin"})


def test_refused_and_invalid_values_name_the_flag():
    with pytest.raises(CliError, match="--api-server-count 2: not supported"):
        parse_settings(["--api-server-count", "2"], environ={})
    parse_settings(["--api-server-count", "1"], environ={})
    with pytest.raises(CliError, match="--max-queue: .*integer"):
        parse_settings(["--max-queue", "many"], environ={})


def test_unknown_flag_stops_the_start_naming_the_nearest(tmp_path):
    res = serve_cli("--model", str(TINY_MODEL), "--max-queue-wiat-s", "3")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--max-queue-wiat-s: did you mean --max-queue-wait-s?" in res.stderr


def test_help_works_as_vllms_with_any_flags(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text("max-num-seqs: 12\n")
    res = serve_cli("--quantization", "fp8", "--kv-cache-dtype", "auto", "--config", str(config),
              "--help")
    assert res.returncode == 0, res.stderr[-2000:]
    for group in ("Frontend", "ModelConfig", "CacheConfig", "SchedulerConfig", "Gateway"):
        assert group in res.stdout
    res = serve_cli("--help=gateway")
    assert res.returncode == 0 and "--max-queue-wait-s" in res.stdout
    assert "--quantization" not in res.stdout
