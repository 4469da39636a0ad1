"""The command line as users run it: a real process, its exit code, its stdout and stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

MODEL_FILE = textwrap.dedent("""
    import torch
    from torch import nn


    def build():
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 3))
        model[3].requires_grad_(False)
        return model, torch.randn(2, 3, 32, 32)


    def broken():
        raise ValueError("the checkpoint path is not set")
""")


def gradaudit_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "gradaudit")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "gradaudit"]


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "models.py").write_text(MODEL_FILE)
    return tmp_path


def run(folder, *args, command=None):
    return subprocess.run([*(command or gradaudit_command()), *args], cwd=folder, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"})


def test_clean_run_exits_0_and_keeps_stderr_empty_when_not_a_terminal(folder):
    result = run(folder, "scan", "models.py:build", "--html", "out.html")
    assert result.returncode == 0, result.stderr
    assert "GA101" in result.stdout and "HTML report: out.html" in result.stdout
    assert result.stderr == ""  # no progress line: stderr is a pipe here
    assert (folder / "out.html").stat().st_size > 0


def test_python_dash_m_is_the_same_program(folder):
    via_module = run(folder, "scan", "models.py:build", "--no-html", "--json", "-",
                     command=[sys.executable, "-m", "gradaudit"])
    via_script = run(folder, "scan", "models.py:build", "--no-html", "--json", "-")
    assert via_module.returncode == via_script.returncode == 0
    assert json.loads(via_module.stdout)["summary"] == json.loads(via_script.stdout)["summary"]


def test_threshold_exits_1(folder):
    result = run(folder, "scan", "models.py:build", "--no-html", "--fail-on-waste", "-q")
    assert result.returncode == 1
    assert result.stderr.strip().endswith("waste findings (--fail-on-waste)")


@pytest.mark.parametrize("args, message", [
    (["scan", "gone.py:build"], "gradaudit: error: file not found: gone.py"),
    (["scan", "models.py:broken"], "gradaudit: error: the factory models.py:broken raised ValueError: "
                                   "the checkpoint path is not set"),
    (["scan", "models.py:build", "--dot", "/proc/no/such/file.dot"], "gradaudit: error: cannot write --dot"),
])
def test_failures_exit_2_with_a_short_message(folder, args, message):
    result = run(folder, *args)
    assert result.returncode == 2
    assert result.stderr.startswith(message)
    assert len(result.stderr.strip().splitlines()) <= 2
    assert "Traceback" not in result.stderr


def test_usage_errors_exit_2(folder):
    result = run(folder, "scan", "models.py:build", "--device", "tpu")
    assert result.returncode == 2
    assert "Invalid value for '--device'" in result.stderr
