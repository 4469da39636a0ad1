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
# The ReLU's result (2x8x30x30 float32 = 57600 bytes) is saved twice: by the ReLU, which reads only
# its sign, and by the max-pool, which does not read it (it keeps its indices). Dropping the
# max-pool's save and keeping the ReLU's as 1 bit per element (ceil(14400 / 8) = 1800 bytes) frees
# 57600 - 1800 = 55800 bytes; neither fix alone frees any.
RELU_PACKED_BYTES = 2 * 8 * 30 * 30 * 4 - (2 * 8 * 30 * 30 + 7) // 8  # = 55800
ALL_FIXES_BYTES = POOLED_INPUT_BYTES + RELU_PACKED_BYTES  # = 70200


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
    # the threshold compares what fixing every waste finding together frees: 14400 by dropping the
    # frozen conv's input + 55800 by bit-packing the ReLU's result = 70200 bytes, the summary's
    # reclaimable_with_all_fixes_bytes (= reclaimable_with_bitpacking_bytes: no code-change finding)
    summary = scan_json(runner, "models.py:build")["summary"]
    assert summary["reclaimable_bytes"] == POOLED_INPUT_BYTES
    assert summary["reclaimable_with_bitpacking_bytes"] == summary["reclaimable_with_all_fixes_bytes"] == ALL_FIXES_BYTES
    assert summary["rewrite_bytes"] == 0
    assert scan(runner, "models.py:build", "--no-html", "--max-reclaimable", f"{ALL_FIXES_BYTES}B").exit_code == 0
    over = scan(runner, "models.py:build", "--no-html", "--max-reclaimable", "1KiB")
    assert over.exit_code == 1
    assert (f"fixing the 3 waste findings would free 68.6 KiB ({ALL_FIXES_BYTES} bytes), which exceeds "
            f"--max-reclaimable 1KiB (1024 bytes): 14.1 KiB by dropping saves whose values backward never "
            f"reads, 54.5 KiB by keeping 1 bit per element of saves backward reads only as a sign or mask"
            ) in over.stderr
    assert over.stderr.count("\n") == 1


def test_ignore_defines_what_the_threshold_counts(runner):
    # The tracker's example: with every family that fires here ignored, the summary said
    # "0 waste findings" and the threshold still failed on the 14400 bytes of GA101's drop.
    # Now nothing selected frees a byte: 0 B reclaimable, exit 0.
    result = scan(runner, "models.py:build", "--no-html", "-q", "--ignore", "GA1,GA2,GA3,GA4",
                  "--max-reclaimable", "1KiB")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ("Sequential: 98.4 KiB held for backward, 0 B reclaimable (0 B with bit-packing), "
                             "0 waste findings (ignore GA1,GA2,GA3,GA4)\n")
    assert result.stderr == ""
    document = scan_json(runner, "models.py:build", "--ignore", "GA1,GA2,GA3,GA4")
    assert document["ignore"] == ["GA1", "GA2", "GA3", "GA4"] and document["select"] == []
    summary = document["summary"]
    assert (summary["reclaimable_bytes"], summary["reclaimable_with_bitpacking_bytes"],
            summary["reclaimable_with_all_fixes_bytes"], summary["waste_findings"]) == (0, 0, 0, 0)
    assert all(m["own_reclaimable_bytes"] == 0 for m in document["modules"])


def test_an_ignored_rule_keeps_its_storage_for_the_selected_ones(runner):
    # --ignore GA4: the ReLU's result stays a float tensor, so dropping the max-pool's save of the
    # same storage (GA301) frees nothing; only GA101's 14400 bytes count, everywhere.
    document = scan_json(runner, "models.py:build", "--ignore", "GA4")
    summary = document["summary"]
    assert summary["reclaimable_bytes"] == summary["reclaimable_with_all_fixes_bytes"] == POOLED_INPUT_BYTES
    by_code = {f["code"]: f for f in document["findings"]}
    assert "GA401" not in by_code
    assert by_code["GA301"]["severity"] == "info" and by_code["GA301"]["bytes_together"] == 0
    assert "a save of a rule not selected" in by_code["GA301"]["message"]
    assert [f["bytes_together"] for f in document["findings"] if f["severity"] == "waste"] == [POOLED_INPUT_BYTES]
    assert scan(runner, "models.py:build", "--no-html", "--ignore", "GA4", "--max-reclaimable",
                f"{POOLED_INPUT_BYTES}B").exit_code == 0
    # GA301 is information now: ignoring GA1 too leaves no waste to fail on
    assert scan(runner, "models.py:build", "--no-html", "--ignore", "GA1,GA4", "--fail-on-waste").exit_code == 0
    text = scan(runner, "models.py:build", "--no-html", "--ignore", "GA4").stdout
    assert "reclaimable with bit-packing  14.1 KiB" in text
    assert "counting the selected rules only (ignore GA4)" in text
    # --select alone: GA101's drop, 14400 bytes, one byte over a 14399-byte limit
    over = scan(runner, "models.py:build", "--no-html", "--select", "GA1", "--max-reclaimable", "14399B")
    assert over.exit_code == 1 and f"({POOLED_INPUT_BYTES} bytes), which exceeds" in over.stderr


@pytest.mark.parametrize("args, option, entry", [
    (["--ignore", "GA4O1"], "--ignore", "GA4O1"),
    (["--select", "GA9999"], "--select", "GA9999"),
    (["--select", "GA1,ga3", "--select", "GB"], "--select", "GB"),
])
def test_unknown_codes_exit_2_before_the_model_is_built(runner, args, option, entry):
    codes = [r.code for r in all_rules()]
    # models.py:broken raises when built: the code is refused first
    result = scan(runner, "models.py:broken", "--no-html", *args)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"gradaudit: error: {option} {entry}: no rule code starts with {entry}")
    assert f"codes are {codes[0]}..{codes[-1]}, `gradaudit rules` lists them" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""


def test_unknown_code_suggests_the_nearest(runner):
    result = scan(runner, "models.py:build", "--ignore", "GA4O1")
    assert "no rule code starts with GA4O1 (did you mean GA401?);" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--trainable", "fc.*"], "--trainable 'fc.*' matches no parameter"),
    (["--trainable", "3"], "nearest: 3.weight, 3.bias, "),  # globs match whole names: '3' is not '3.*'
    (["--freeze", "3.weigth"], "--freeze '3.weigth' matches no parameter (globs match whole names from "
                               "named_parameters()); nearest: 3.weight, "),
    (["--trainable", "0.*", "--freeze", "*.bais"], "--freeze '*.bais' matches no parameter"),
])
def test_patterns_matching_no_parameter_exit_2(runner, args, message):
    result = scan(runner, "models.py:build", "--no-html", *args)
    assert result.exit_code == 2
    assert result.stderr.startswith("gradaudit: error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""


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


def test_target_cuda_on_meta_is_recorded_in_the_json(runner):
    document = scan_json(runner, "models.py:build", "--device", "meta", "--target", "cuda")
    assert (document["device"], document["target"]) == ("meta", "cuda")
    # no batch norm here: the same figures as a scan standing for the CPU
    assert document["summary"] == scan_json(runner, "models.py:build", "--device", "meta")["summary"]
    assert scan_json(runner, "models.py:build")["target"] == "cpu"
    assert scan_json(runner, "models.py:on_meta", "--target", "cuda")["target"] == "cuda"  # auto: on meta


@pytest.mark.parametrize("args, runs_on", [(["--device", "cpu"], "cpu"), ([], "cpu")])  # [] : auto, a CPU model
def test_target_cuda_without_the_meta_device_exits_2(runner, args, runs_on):
    result = scan(runner, "models.py:build", *args, "--target", "cuda", "--no-html")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--target cuda needs --device meta" in lines[0] and f"runs on {runs_on}" in lines[0]


def test_unknown_target_is_a_usage_error(runner):
    result = scan(runner, "models.py:build", "--device", "meta", "--target", "tpu", "--no-html")
    assert result.exit_code == 2
    assert "'tpu' is not one of 'cpu', 'cuda'" in result.stderr


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

    result = scan(runner, "models.py:build", "--no-html", "--trim")
    assert result.exit_code == 0, result.stderr
    assert "held for backward" in result.stdout and "peak, forward+backward" in result.stdout
    assert "With gradaudit.trim (measured, masks as bits):" in result.stdout  # the CPU: trim's default, bits


def test_trim_without_the_trimming_module_exits_2(runner, monkeypatch):
    monkeypatch.setitem(sys.modules, "gradaudit.trimming", None)  # import of it raises ImportError
    result = scan(runner, "models.py:build", "--no-html", "--trim")
    assert result.exit_code == 2
    assert "--trim is not available" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_help_documents_exit_codes(runner):
    """Every command: 0 success, 1 a negative verdict, 2 an error (issue 43: fit and plan exited 2 for
    "does not fit" as for a mistyped option, and the top-level help showed scan's codes as everyone's)."""
    text = " ".join(runner.invoke(cli, ["--help"]).stdout.split())
    assert "Exit codes (every command; each one's --help says what its own mean):" in text
    assert "1 a negative verdict: scan's waste over a threshold, a fit that does not fit" in text
    assert "2 an error or a usage error" in text
    for command, verdict in (("scan", "1  a --fail-on-waste"), ("fit", "1  the step does not fit and no remedy"),
                             ("plan", "1  no plan of the candidate blocks fits")):
        text = runner.invoke(cli, [command, "--help"]).stdout
        assert "Exit codes:" in text and verdict in text and "2  something prevented" in text, command


def test_a_mistyped_option_is_an_error_not_a_verdict(runner):
    for command in ("fit", "plan"):
        result = runner.invoke(cli, [command, "models.py:build", "--memroy", "1GiB"])
        assert result.exit_code == 2 and "No such option '--memroy'" in result.output, command


def test_rules_lists_the_whole_catalogue(runner):
    result = runner.invoke(cli, ["rules"])
    assert result.exit_code == 0
    for r in all_rules():
        assert f"{r.code}  {r.name}" in result.stdout
    assert f"{len(all_rules())} rules." in result.stdout


def test_rules_as_json_carry_what_explain_prints(runner):
    result = runner.invoke(cli, ["rules", "--json"])
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    assert document["kind"] == "rules" and [r["code"] for r in document["rules"]] == [r.code for r in all_rules()]
    for entry, r in zip(document["rules"], all_rules()):
        assert (entry["name"], entry["severity"], entry["doc"], entry["fix_code"]) == (r.name, r.severity, r.doc,
                                                                                      r.fix_code)
        assert entry["sections"] == r.sections() and entry["docs"] == f"gradaudit explain {r.code}"
        assert entry["docs_url"] == f"docs/rules/{r.code}.md"


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
    from gradaudit.cli import CommandOptions, Progress, run_scan

    progress = Progress(enabled=True)
    code = run_scan(CommandOptions(spec="models.py:build", html=None, quiet=True, progress=progress))
    captured = capsys.readouterr()
    assert code == 0
    assert "\rgradaudit: running the forward..." in captured.err
    assert "\rgradaudit: building the model (models.py:build)..." in captured.err
    assert captured.err.endswith("\r")  # the status line is blanked before the summary prints
    assert "held for backward" in captured.out


def test_a_pipe_gets_whole_lines_and_columns_still_sets_the_width(runner, tmp_path, monkeypatch):
    # CliRunner's stdout is no terminal, as a CI log or `| tee` is not: the SOURCE column is never cut
    deep = ("d" * 50) + "/" + ("e" * 50)
    (tmp_path / deep).mkdir(parents=True)
    (tmp_path / deep / "models.py").write_text(MODEL_FILE)
    monkeypatch.delenv("COLUMNS", raising=False)
    piped = scan(runner, f"{deep}/models.py:build", "--no-html")
    assert piped.exit_code == 0 and f"{deep}/models.py:" in piped.stdout and "…" not in piped.stdout
    monkeypatch.setenv("COLUMNS", "80")
    narrow = scan(runner, f"{deep}/models.py:build", "--no-html")
    assert f"{deep}/models.py:" not in narrow.stdout and "…" in narrow.stdout
    assert max(len(line) for line in narrow.stdout.splitlines() if line.lstrip().startswith("GA")) <= 80


def test_output_formats_for_ci_annotate_the_findings_source_lines(runner):
    """--output-format github: one workflow command per finding, on the line that built its layer
    (models.py, as the scan names it); sarif: one SARIF 2.1.0 run with the same findings; json: the
    report as --json - prints it (issue 43's CLI conventions)."""
    dash = scan(runner, "models.py:build", "--no-html", "--json", "-")
    findings = json.loads(dash.stdout)["findings"]
    assert findings and all(f["source"] and f["source"].startswith("models.py:") for f in findings)

    github = scan(runner, "models.py:build", "--no-html", "--output-format", "github")
    assert github.exit_code == 0, github.stderr
    lines = github.stdout.splitlines()
    annotations = [line for line in lines if line.startswith("::")]
    assert len(annotations) == len(findings) and lines[-1].startswith("Sequential: ")
    for line, finding in zip(annotations, findings):
        level = "notice" if finding["severity"] == "info" else "warning"
        path, _, number = finding["source"].rpartition(":")
        assert line.startswith(f"::{level} file={path},line={number},title=gradaudit {finding['code']} "), line
        assert f"(gradaudit explain {finding['code']})" in line

    sarif = scan(runner, "models.py:build", "--no-html", "--output-format", "sarif")
    assert sarif.exit_code == 0, sarif.stderr
    document = json.loads(sarif.stdout)
    run = document["runs"][0]
    assert document["version"] == "2.1.0" and run["tool"]["driver"]["name"] == "gradaudit"
    assert [r["ruleId"] for r in run["results"]] == [f["code"] for f in findings]
    assert {r["id"] for r in run["tool"]["driver"]["rules"]} == {f["code"] for f in findings}
    first = run["results"][0]["locations"][0]["physicalLocation"]
    assert f'{first["artifactLocation"]["uri"]}:{first["region"]["startLine"]}' == findings[0]["source"]
    assert sarif.stderr.strip().startswith("Sequential: ")  # the summary line, off stdout

    as_json = scan(runner, "models.py:build", "--no-html", "--output-format", "json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["findings"] == json.loads(dash.stdout)["findings"]
    for args in (["--output-format", "json", "--json", "x.json"], ["--output-format", "sarif", "--json", "-"],
                 ["--output-format", "yaml"]):
        refused = runner.invoke(cli, ["scan", "models.py:build", "--no-html", *args])
        assert refused.exit_code == 2, args
