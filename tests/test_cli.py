"""The command line through click's runner: options, outputs, thresholds and every error path."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap

import pytest
from click.testing import CliRunner

from gradaudit.cli import cli
from gradaudit.rules import all_rules

# A frozen convolution behind a trainable one: its input (the max-pool output) is held only for a
# weight gradient nobody asked for. Input 2x3x32x32 -> conv 2x8x30x30 -> pool 2x8x15x15.
MODEL_FILE = textwrap.dedent("""
    import torch
    from torch import nn


    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 3))
        model[3].requires_grad_(False)
        return model


    def build():
        return make(), torch.randn(2, 3, 32, 32)


    def batch():
        return torch.randn(2, 3, 32, 32)


    def linear():
        return nn.Linear(4, 4)


    def broken():
        raise ValueError("the checkpoint path is not set")


    def not_a_model():
        return {"weights": 1}


    def on_meta():
        with torch.device("meta"):
            return make(), torch.randn(2, 3, 32, 32)


    def frozen():
        return make().requires_grad_(False), torch.randn(2, 3, 32, 32)
""")
POOLED_INPUT_BYTES = 2 * 8 * 15 * 15 * 4  # = 14400, the frozen conv's saved input


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models.py").write_text(MODEL_FILE)
    return CliRunner()


def scan(runner, *args):
    return runner.invoke(cli, ["scan", *args], catch_exceptions=False)


def scan_json(runner, *args):
    result = scan(runner, *args, "--json", "-", "--no-html")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_scan_prints_summary_and_writes_html_by_default(runner, tmp_path):
    result = scan(runner, "models.py:build")
    assert result.exit_code == 0, result.stderr
    assert "GA101" in result.stdout
    assert "HTML report: gradaudit-report.html" in result.stdout
    html = (tmp_path / "gradaudit-report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html")


def test_json_to_stdout_is_the_report_and_the_summary_moves_to_stderr(runner):
    result = scan(runner, "models.py:build", "--json", "-", "--no-html")
    document = json.loads(result.stdout)
    assert document["schema_version"] == 1
    assert document["model"] == "Sequential"
    conv = [f for f in document["findings"] if f["code"] == "GA101"]
    assert [f["module"] for f in conv] == ["3"]
    assert conv[0]["bytes"] == POOLED_INPUT_BYTES
    assert "GA101" in result.stderr


def test_json_svg_and_dot_files(runner, tmp_path):
    args = ["models.py:build", "--no-html", "--json", "r.json", "--dot", "g.dot"]
    if shutil.which("dot"):
        args += ["--svg", "g.svg"]
    result = scan(runner, *args)
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["schema_version"] == 1
    assert (tmp_path / "g.dot").read_text().lstrip().startswith(("digraph", "strict digraph"))
    assert "JSON: r.json" in result.stdout and "DOT graph: g.dot" in result.stdout
    assert not (tmp_path / "gradaudit-report.html").exists()
    if shutil.which("dot"):
        assert "<svg" in (tmp_path / "g.svg").read_text()


def test_quiet_prints_one_line(runner):
    result = scan(runner, "models.py:build", "-q", "--no-html")
    assert result.exit_code == 0
    assert result.stdout.count("\n") == 1
    assert "held for backward" in result.stdout and "waste findings" in result.stdout


def test_select_and_ignore_take_prefixes_comma_separated_or_repeated(runner):
    codes = {f["code"] for f in scan_json(runner, "models.py:build")["findings"]}
    assert {"GA101", "GA301"} <= codes
    assert {f["code"] for f in scan_json(runner, "models.py:build", "--select", "GA1")["findings"]} == {"GA101"}
    ignored = {f["code"] for f in scan_json(runner, "models.py:build", "--ignore", "GA1,GA3",
                                            "--ignore", "GA4")["findings"]}
    assert not any(c.startswith(("GA1", "GA3", "GA4")) for c in ignored)
    # longest prefix wins: ignore the family, select one code back
    back = scan_json(runner, "models.py:build", "--ignore", "GA", "--select", "GA101")["findings"]
    assert {f["code"] for f in back} == {"GA101"}


def test_fail_on_waste_exits_1_with_a_line_on_stderr(runner):
    result = scan(runner, "models.py:build", "--no-html", "--fail-on-waste")
    assert result.exit_code == 1
    assert "waste findings (--fail-on-waste)" in result.stderr
    clean = scan(runner, "models.py:build", "--no-html", "--fail-on-waste", "--select", "GA9")
    assert clean.exit_code == 0, clean.stderr


def test_max_reclaimable_threshold(runner):
    reclaimable = scan_json(runner, "models.py:build")["summary"]["reclaimable_bytes"]
    assert reclaimable >= POOLED_INPUT_BYTES
    assert scan(runner, "models.py:build", "--no-html", "--max-reclaimable", f"{reclaimable}B").exit_code == 0
    over = scan(runner, "models.py:build", "--no-html", "--max-reclaimable", "1KiB")
    assert over.exit_code == 1
    assert f"({reclaimable} bytes) exceeds --max-reclaimable 1KiB (1024 bytes)" in over.stderr


def test_inputs_from_a_second_factory_or_a_shape(runner):
    by_spec = scan_json(runner, "models.py:make", "--inputs", "models.py:batch")
    by_shape = scan_json(runner, "models.py:make", "--input-shape", "2,3,32,32")
    assert by_spec["summary"] == by_shape["summary"]
    assert by_spec["summary"]["saved_bytes"] > 0


def test_trainable_and_freeze_are_a_what_if(runner):
    # everything frozen except the last conv: nothing upstream needs a gradient, nothing is wasted
    last_only = scan_json(runner, "models.py:build", "--trainable", "3.*")
    assert last_only["summary"]["waste_findings"] == 0
    frozen_first = scan(runner, "models.py:build", "--no-html", "--freeze", "0.*")
    assert frozen_first.exit_code == 2
    assert "nothing requires grad" in frozen_first.stderr
    # --trainable unfreezes what the factory froze
    assert scan_json(runner, "models.py:frozen", "--trainable", "0.*")["summary"]["waste_findings"] > 0


def test_eval_and_train_set_the_mode(runner):
    assert scan_json(runner, "models.py:build", "--eval")["training"] is False
    assert scan_json(runner, "models.py:build", "--train")["training"] is True


def test_meta_device_builds_without_memory(runner):
    document = scan_json(runner, "models.py:build", "--device", "meta")
    assert document["device"] == "meta"
    assert any(f["code"] == "GA101" and f["bytes"] == POOLED_INPUT_BYTES for f in document["findings"])


def test_verify_on_meta_is_refused(runner):
    result = scan(runner, "models.py:build", "--device", "meta", "--verify", "--no-html")
    assert result.exit_code == 2
    assert "--verify" in result.stderr and "meta" in result.stderr


def test_verify_marks_findings_proven(runner):
    document = scan_json(runner, "models.py:build", "--verify")
    assert document["verified"] is True
    assert all(f["proven"] for f in document["findings"] if f["code"] == "GA101")


def test_package_module_spec(runner, tmp_path, monkeypatch):
    package = tmp_path / "zoo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(MODEL_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert scan_json(runner, "zoo.nets:build")["model"] == "Sequential"


@pytest.mark.parametrize("args, message", [
    (["missing.py:build"], "file not found: missing.py"),
    (["models.py:nope"], "models.py has no attribute 'nope'; it defines: batch, broken, build"),
    (["models.py:broken"], "the factory models.py:broken raised ValueError: the checkpoint path is not set"),
    (["models.py:not_a_model"], "returned dict, not a torch.nn.Module"),
    (["models.py:linear", "--input-shape", "2,5"], "the model's forward raised RuntimeError"),
    (["models.py:linear", "--input-shape", "2,5"], "check that the inputs"),
    (["models.py:linear"], "no inputs: the factory models.py:linear returned only a model"),
    (["models.py:frozen"], "nothing requires grad"),
    (["models.py"], "malformed SPEC 'models.py'"),
    (["models.py:on_meta", "--device", "cpu"], "cannot move the model to cpu"),
    (["models.py:9lives"], "malformed SPEC"),
    (["no_such_package.mod:build"], "no module named 'no_such_package'"),
    (["models.py:build", "--input-shape", "2,y"], "malformed --input-shape"),
    (["models.py:make", "--input-shape", "2,3,32,32", "--dtype", "float33"], "unknown --dtype"),
    (["models.py:build", "--max-reclaimable", "lots"], "malformed size 'lots'"),
    (["models.py:build", "--json", "no/such/dir/r.json"], "cannot write --json no/such/dir/r.json"),
    (["models.py:build", "--html", "."], "cannot write --html .: it is a directory"),
])
def test_errors_exit_2_with_one_or_two_lines_and_no_traceback(runner, args, message):
    result = scan(runner, *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert result.stderr.startswith("gradaudit: error: ")
    assert 1 <= len(result.stderr.strip().splitlines()) <= 2
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_syntax_error_names_file_and_line(runner, tmp_path):
    (tmp_path / "bad.py").write_text("import torch\n\ndef build(:\n    pass\n")
    result = scan(runner, "bad.py:build")
    assert result.exit_code == 2
    assert "syntax error in" in result.stderr and "bad.py:3" in result.stderr
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback(runner):
    result = scan(runner, "models.py:broken", "--debug")
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "ValueError: the checkpoint path is not set" in result.stderr


def test_trim_reports_held_and_peak_before_and_after(runner):
    from gradaudit import torchapi

    if not torchapi.has("node creation hook"):
        pytest.skip("gradaudit.trim needs torch >= 2.14 (the node creation hook)")
    result = scan(runner, "models.py:build", "--no-html", "--trim")
    assert result.exit_code == 0, result.stderr
    assert "held for backward" in result.stdout and "peak, forward+backward" in result.stdout
    assert "With gradaudit.trim (measured):" in result.stdout


def test_trim_without_the_trimming_module_exits_2(runner, monkeypatch):
    monkeypatch.setitem(sys.modules, "gradaudit.trimming", None)  # import of it raises ImportError
    result = scan(runner, "models.py:build", "--no-html", "--trim")
    assert result.exit_code == 2
    assert "--trim is not available" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_help_documents_exit_codes(runner):
    for args in ([], ["scan"]):
        text = runner.invoke(cli, [*args, "--help"]).stdout
        assert "Exit codes:" in text
        assert "0  the scan ran" in text and "1  a --fail-on-waste" in text and "2  something prevented" in text


def test_rules_lists_the_whole_catalogue(runner):
    result = runner.invoke(cli, ["rules"])
    assert result.exit_code == 0
    for r in all_rules():
        assert f"{r.code}  {r.name}" in result.stdout
    assert f"{len(all_rules())} rules." in result.stdout


def test_explain_prints_the_rule_documentation(runner):
    result = runner.invoke(cli, ["explain", "ga101"])
    assert result.exit_code == 0
    rule = next(r for r in all_rules() if r.code == "GA101")
    assert result.stdout.startswith(f"GA101 {rule.name} (waste)")
    assert rule.doc in result.stdout
    assert "gradaudit.trim" in result.stdout  # the fix snippet
    by_name = runner.invoke(cli, ["explain", rule.name])
    assert by_name.stdout == result.stdout


def test_explain_unknown_rule_exits_2(runner):
    result = runner.invoke(cli, ["explain", "GA999"])
    assert result.exit_code == 2
    assert "no rule 'GA999'" in result.stderr and "gradaudit rules" in result.stderr


def test_auto_device_follows_a_model_built_on_meta(runner):
    assert scan_json(runner, "models.py:on_meta")["device"] == "meta"


def test_progress_goes_to_stderr_and_is_cleared(runner, capsys):
    from gradaudit.cli import Progress, ScanOptions, run_scan

    progress = Progress(enabled=True)
    code = run_scan(ScanOptions(spec="models.py:build", html=None, quiet=True, progress=progress))
    captured = capsys.readouterr()
    assert code == 0
    assert "\rgradaudit: running the forward..." in captured.err
    assert "\rgradaudit: building the model (models.py:build)..." in captured.err
    assert captured.err.endswith("\r")  # the status line is blanked before the summary prints
    assert "held for backward" in captured.out
