"""Command-line surface: --help documents every setting; missing models give clear messages."""

from __future__ import annotations

import subprocess
import sys

from serve.settings import Settings
from tests.helpers import ROOT


def run(*cmd: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_help_documents_every_setting():
    res = run(sys.executable, "-m", "serve", "--help=all")
    assert res.returncode == 0, res.stderr
    for name, field in Settings.model_fields.items():
        if name == "vllm_args":  # the vLLM flags given, not a flag of its own
            continue
        flag = "--" + name.replace("_", "-")
        assert flag in res.stdout, flag
        assert field.description, f"{name} has no description"


def test_missing_model_dir_names_make_demo():
    res = run(sys.executable, "-m", "serve", "--model", "/nonexistent/model")
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
    code = """
import json
from serve.engine import vllm_cli_args
from serve.settings import Settings
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for device in ("cpu", "cuda"):
    s = Settings(device=device, port=8123, max_num_seqs=48)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_cli_args(s))
    out.append({k: [v, getattr(args, k)] for k, v in s.engine_kwargs().items()}
               | {"port": [8123, args.port]})
print(json.dumps(out))
"""
    res = run(sys.executable, "-c", code)
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    for device in json.loads(res.stdout.strip().splitlines()[-1]):
        assert device["max_num_seqs"] == [48, 48]
        for key, (ours, parsed) in device.items():
            assert ours == parsed, key


def test_step_budget_smaller_than_the_largest_image_is_refused_at_start():
    from tests.helpers import TINY_MODEL

    res = run(sys.executable, "-m", "serve", "--model", str(TINY_MODEL),
              "--max-num-batched-tokens", "64", "--max-num-crops", "16")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--max-num-batched-tokens 64" in res.stderr and "--max-num-crops 16" in res.stderr
