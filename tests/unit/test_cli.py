"""Command-line surface: --help documents every setting; missing models give clear messages."""

from __future__ import annotations

import subprocess

from serve.settings import Settings
from tests.helpers import ROOT, TINY_MODEL, serve_cli


def run(*cmd: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_help_documents_every_setting():
    res = serve_cli("--help=all")
    assert res.returncode == 0, res.stderr
    for name, field in Settings.model_fields.items():
        if name == "vllm_args":  # the vLLM flags given, not a flag of its own
            continue
        flag = "--" + name.replace("_", "-")
        assert flag in res.stdout, flag
        assert field.description, f"{name} has no description"


def test_missing_model_dir_names_make_demo():
    res = serve_cli("--model", "/nonexistent/model")
    assert res.returncode == 2
    assert "make demo" in res.stderr and "Traceback" not in res.stderr


def test_make_serve_without_weights_is_a_clear_message(tmp_path):
    res = run("make", "-s", "serve", f"WEIGHTS={tmp_path / 'absent'}")
    assert res.returncode != 0
    assert "make demo" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_raw_vllm_baseline_gets_exactly_our_engine_arguments():
    """``make bench``'s raw vLLM runs the engine our settings describe: vLLM's own parser reads
    back every engine argument, on CPU and GPU defaults alike."""
    # vLLM's own parser reads the arguments back: without vLLM this fails, it does not skip.
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from serve.engine import vllm_cli_args

    for device in ("cpu", "cuda"):
        s = Settings(device=device, port=8123, max_num_seqs=48)
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_cli_args(s))
        assert args.max_num_seqs == 48 and args.port == 8123
        for key, ours in s.engine_kwargs().items():
            assert getattr(args, key) == ours, (device, key)


def test_step_budget_smaller_than_the_largest_image_is_refused_at_start():
    res = serve_cli("--model", str(TINY_MODEL), "--max-num-batched-tokens", "64",
                    "--max-num-crops", "16")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--max-num-batched-tokens 64" in res.stderr and "--max-num-crops 16" in res.stderr
