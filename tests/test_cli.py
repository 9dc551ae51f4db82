"""Command-line surface: --help documents every setting; missing models give clear messages."""

from __future__ import annotations

import subprocess
import sys

from serve.settings import Settings
from tests.conftest import ROOT


def run(*cmd: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_help_documents_every_setting():
    res = run(sys.executable, "-m", "serve", "--help")
    assert res.returncode == 0, res.stderr
    for name, field in Settings.model_fields.items():
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
