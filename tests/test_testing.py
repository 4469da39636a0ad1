"""assert_no_waste and the pytest plugin: fail on waste (every waste rule), pass on clean models."""

from __future__ import annotations

import contextlib

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import gradaudit
from gradaudit.rules import all_rules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def frozen(module: nn.Module) -> nn.Module:
    return module.requires_grad_(False)


class Autocast(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x)


class EagerAttention(nn.Module):
    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x):
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        probabilities = (q @ k.transpose(-2, -1) / (w // self.heads) ** 0.5).softmax(-1)
        return (probabilities @ v).transpose(1, 2).reshape(b, n, w)


class LastToken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 64)
        self.head = nn.Linear(64, 2)

    def forward(self, x):
        return self.head(self.body(x)[:, -1])


class SavesInputToo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(x, y)  # backward reads only y
        return y

    @staticmethod
    def backward(ctx, grad):
        _x, y = ctx.saved_tensors
        return grad * (1 - y * y)


class Tanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class Apply(nn.Module):
    def __init__(self, function, width: int = 32) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.function = function
        self.out = nn.Linear(width, width)

    def forward(self, x):
        return self.out(self.function.apply(self.linear(x)))


def _trigger(code: str):
    """(model, inputs, verify) whose audit yields a waste finding ``code`` with bytes to free."""
    torch.manual_seed(0)
    images = torch.randn(2, 3, 16, 16)
    if code == "GA101":  # trainable conv, then a frozen one holding the first one's output
        return nn.Sequential(nn.Conv2d(3, 8, 3), frozen(nn.Conv2d(8, 4, 3))), images, False
    if code == "GA102":  # a computed (normalised) weight, input needs no gradient
        conv = nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 4, 3))
        return conv, images, False
    if code == "GA201":
        return nn.Sequential(nn.Conv2d(3, 8, 3), frozen(nn.BatchNorm2d(8))).eval(), images, False
    if code == "GA301":
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.MaxPool2d(2)), images, False
    if code == "GA401":  # the next Linear is frozen, so only ReLU keeps its result: as a sign
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), frozen(nn.Linear(16, 4))), torch.randn(4, 8), False
    if code == "GA402":
        return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)).train(), torch.randn(4, 8), False
    if code == "GA403":  # the fused dropout CUDA runs, called by name on the CPU
        from tests.fixtures.rule_models import FusedDropoutMLP
        return FusedDropoutMLP().train(), torch.randn(8, 16), False
    if code == "GA501":  # the input requires grad, only the head trains
        model = nn.Sequential(frozen(nn.Linear(8, 16)), nn.GELU(), frozen(nn.Linear(16, 16)), nn.GELU(),
                              nn.Linear(16, 4))
        return model, torch.randn(4, 8, requires_grad=True), False
    if code == "GA601":
        return LastToken(), torch.randn(4, 32, 16), False
    if code == "GA602":  # sequence parallel: the column-parallel linear keeps its gathered input
        from tests.test_ranks import sequence_parallel

        return (*sequence_parallel(), False)
    if code == "GA701":
        model = nn.Sequential(nn.Linear(16, 16), frozen(nn.Linear(16, 16)), frozen(nn.Linear(16, 16)))
        return Autocast(model), torch.randn(4, 16), False
    if code == "GA801":
        return EagerAttention(), torch.randn(2, 8, 16), False
    if code == "GA000":
        return Apply(SavesInputToo), torch.randn(8, 32), True
    if code in ("GA003", "GA703"):  # compiled models (GA003's waste read off the backward graph)
        from tests.fixtures.rule_models import CompiledConvWeights, CompiledFrozenConv

        torch._dynamo.reset()  # a fresh compile: dynamo's recompile limit counts across the suite
        fixture = CompiledFrozenConv if code == "GA003" else CompiledConvWeights
        model, inputs, _ = fixture.build()
        return model, inputs, False
    if code in ("GA001", "GA002", "GA202", "GA302", "GA702"):
        from tests.fixtures.rule_models import GatherAndPow, LanguageModelLoss, NormBiasOnly, PoolingHead

        fixture = {"GA001": GatherAndPow, "GA002": GatherAndPow, "GA202": NormBiasOnly, "GA302": PoolingHead,
                   "GA702": LanguageModelLoss}[code]
        model, inputs, _ = fixture.build()
        return model, inputs, False
    return None


WASTE_RULES = [r.code for r in all_rules() if r.severity == "waste"]


@pytest.mark.parametrize("code", WASTE_RULES)
def test_fails_on_each_waste_rule(code):
    # GA602's model is parallelised: it is built and audited as rank 0 of a fake world of 4
    world = gradaudit.fake_world(4) if code == "GA602" else contextlib.nullcontext()
    with world:
        case = _trigger(code)
        assert case is not None, f"add a wasteful model for the new rule {code} to _trigger"
        model, inputs, verify = case
        with pytest.raises(AssertionError) as caught:
            gradaudit.assert_no_waste(model, inputs, verify=verify)
        message = str(caught.value)
        assert f"  {code} " in message
        assert f"docs: gradaudit explain {code}" in message
        # the same model passes once that rule's code is allowed, unless other rules fire too
        report = gradaudit.audit(model, inputs, verify=verify)
        if {f.code for f in report.waste_findings} == {code}:
            gradaudit.assert_no_waste(model, inputs, verify=verify, allow=[code])


def test_message_names_module_code_source_bytes_and_fix():
    model, images, _ = _trigger("GA101")
    with pytest.raises(AssertionError) as caught:
        gradaudit.assert_no_waste(model, images)
    message = str(caught.value)
    held = 2 * 8 * 14 * 14 * 4  # = 12544: the first conv's 2x8x14x14 float32 output, kept by the frozen conv
    assert message.startswith(f"gradaudit: Sequential: 12.2 KiB ({held} bytes) held for backward could be "
                              f"freed: 12.2 KiB by dropping saves whose values backward never reads; "
                              f"1 waste finding\n")
    # an nn.Sequential built before the audit: no line of its own explains the save, and the line
    # calling assert_no_waste would not either
    assert "  GA101 conv-input-saved-for-frozen-weight  1 (Conv2d)  at unknown source line" in message
    assert "test_testing.py" not in message
    assert f"frees 12.2 KiB alone ({held} bytes)" in message
    assert "fix: Drop the saved input while the weight is frozen" in message


def test_max_reclaimable_bytes_is_a_budget():
    model, images, _ = _trigger("GA101")
    held = 2 * 8 * 14 * 14 * 4  # = 12544
    gradaudit.assert_no_waste(model, images, max_reclaimable_bytes=held)
    with pytest.raises(AssertionError, match=r"\(limit 12.2 KiB\)"):
        gradaudit.assert_no_waste(model, images, max_reclaimable_bytes=held - 1)


def test_allow_takes_code_prefixes():
    # a frozen stem with a max-pool and a ReLU: several families fire
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), frozen(nn.Conv2d(8, 4, 3)))
    images = torch.randn(2, 3, 16, 16)
    codes = {f.code for f in gradaudit.audit(model, images).waste_findings}
    assert {"GA101", "GA301", "GA401"} <= codes
    with pytest.raises(AssertionError) as caught:
        gradaudit.assert_no_waste(model, images, allow=["GA1"])
    assert "GA101" not in str(caught.value) and "allowed: GA1" in str(caught.value)
    gradaudit.assert_no_waste(model, images, allow=sorted({c[:3] for c in codes}))


def test_bit_packable_bytes_are_not_called_unusable():
    # The next Linear is frozen, so only the ReLU keeps its 4x16 float32 result (256 bytes), and
    # backward reads it as a sign: 1 bit per element keeps ceil(64 / 8) = 8 bytes, frees 248.
    model, inputs, _ = _trigger("GA401")
    with pytest.raises(AssertionError) as caught:
        gradaudit.assert_no_waste(model, inputs)
    message = str(caught.value)
    assert message.startswith("gradaudit: Sequential: 248 B (248 bytes) held for backward could be freed: "
                              "248 B by keeping 1 bit per element of saves backward reads only as a sign "
                              "or mask; 1 waste finding\n")
    assert "cannot use" not in message and "never reads" not in message


def test_code_change_findings_count_in_the_all_fixes_figure():
    # head saves body(x)[:, -1], a 4x64 view (1024 bytes) of the 4x32x64 float32 output (32768
    # bytes): GA601's clone frees 32768 - 1024 = 31744 bytes. No save is droppable or bit-packable,
    # so reclaimable (with bit-packing) is 0 and the code change makes up the whole all-fixes figure.
    from gradaudit.report import text

    model, inputs, _ = _trigger("GA601")
    report = gradaudit.audit(model, inputs)
    (view,) = report.waste_findings
    assert view.rewrite and view.bytes == view.bytes_together == 32768 - 1024
    assert (report.reclaimable_bytes, report.reclaimable_with_bitpacking_bytes) == (0, 0)
    assert report.rewrite_bytes == report.reclaimable_with_all_fixes_bytes == 31744
    assert report.summary()["reclaimable_with_all_fixes_bytes"] == 31744
    assert "  reclaimable with all fixes    31 KiB  96.9%" in text.render(report)
    with pytest.raises(AssertionError, match=r"^gradaudit: LastToken: 31 KiB \(31744 bytes\) held for backward "
                                             r"could be freed: 31 KiB by the code changes the findings name"):
        gradaudit.assert_no_waste(model, inputs)
    gradaudit.assert_no_waste(model, inputs, max_reclaimable_bytes=31744)


def test_allow_works_as_ignore_for_findings_and_bytes():
    # conv -> ReLU -> max-pool -> frozen conv on 2x3x16x16: the ReLU's 2x8x14x14 float32 result
    # (12544 bytes) is saved by the ReLU (sign only, GA401) and the max-pool (unread, GA301); the
    # frozen conv saves the 2x8x7x7 pooled input (3136 bytes, unread, GA101).
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), frozen(nn.Conv2d(8, 4, 3)))
    images = torch.randn(2, 3, 16, 16)
    # allow GA4: the ReLU's result stays float, so GA301's drop frees nothing; GA101's 3136 remain
    with pytest.raises(AssertionError) as caught:
        gradaudit.assert_no_waste(model, images, allow=["GA4"])
    assert str(caught.value).startswith("gradaudit: Sequential: 3.06 KiB (3136 bytes) held for backward")
    report = gradaudit.assert_no_waste(model, images, allow=["GA4"], max_reclaimable_bytes=3136)
    assert report.ignore == ("GA4",) and report.reclaimable_with_all_fixes_bytes == 3136
    assert [f.severity for f in report.findings if f.code == "GA301"] == ["info"]
    # allow GA1: 12544 - ceil(3136 / 8) = 12544 - 392 = 12152 bytes, by bit-packing alone
    with pytest.raises(AssertionError, match=r"^gradaudit: Sequential: 11.9 KiB \(12152 bytes\) held for "
                                             r"backward could be freed: 11.9 KiB by keeping 1 bit"):
        gradaudit.assert_no_waste(model, images, allow="GA1")  # a lone string is one entry
    gradaudit.assert_no_waste(model, images, allow=["GA1", "GA4"])
    # the CLI's figure for the same selection
    assert gradaudit.audit(model, images, ignore=["GA1"]).reclaimable_with_all_fixes_bytes == 12152


def test_an_ignored_rule_is_not_reported_as_unexplained():
    # With verify=True the catch-all GA000 reports proven waste no rule explains. The ReLU's result
    # is GA401's (the next Linear is frozen, so it is read only as a sign): ignoring GA401 must not
    # turn it into GA000 "no rule explains it", and its 248 bytes (256 - ceil(64 / 8)) are not counted.
    model, inputs, _ = _trigger("GA401")
    report = gradaudit.audit(model, inputs, verify=True, ignore=["GA4"])
    assert report.findings == [] and report.reclaimable_with_all_fixes_bytes == 0
    gradaudit.assert_no_waste(model, inputs, verify=True, allow=["GA401"])
    assert [(f.code, f.bytes) for f in gradaudit.audit(model, inputs, verify=True).findings] == [("GA401", 248)]


@pytest.mark.parametrize("call, message", [
    (lambda m, x: gradaudit.assert_no_waste(m, x, allow=["GA4O1"]),
     "allow entry GA4O1: no rule code starts with GA4O1 (did you mean GA401?)"),
    (lambda m, x: gradaudit.audit(m, x, select=["GA9999"]), "select entry GA9999: no rule code starts with GA9999"),
    (lambda m, x: gradaudit.audit(m, x, ignore="GA1,XY"), "ignore entry XY: no rule code starts with XY"),
])
def test_unknown_codes_raise(call, message):
    from gradaudit.errors import UnknownCodeError

    model, images, _ = _trigger("GA101")
    with pytest.raises(UnknownCodeError) as caught:
        call(model, images)
    assert str(caught.value).startswith(message)
    assert isinstance(caught.value, gradaudit.GradauditError) and isinstance(caught.value, ValueError)


def test_patterns_matching_no_parameter_raise_and_leave_the_model_alone():
    from gradaudit.errors import NoMatchingParameterError

    model, images, _ = _trigger("GA101")  # parameters 0.weight, 0.bias, 1.weight, 1.bias; 1.* frozen
    with pytest.raises(NoMatchingParameterError, match=r"^trainable '1\.wieght' matches no parameter .*"
                                                       r"nearest: 1\.weight, "):
        gradaudit.audit(model, images, trainable=["0.*", "1.wieght"])
    with pytest.raises(NoMatchingParameterError, match=r"^frozen 'conv' matches no parameter"):
        gradaudit.audit(model, images, frozen="conv")  # a lone string is one pattern
    assert [p.requires_grad for p in model.parameters()] == [True, True, False, False]


def test_trainable_patterns_change_the_verdict():
    model, images, _ = _trigger("GA101")
    gradaudit.assert_no_waste(model, images, trainable=["*"])  # every conv trains: nothing wasted
    assert not model[1].weight.requires_grad  # and the model is left as found


@pytest.mark.parametrize("name, model, inputs, verify", [
    ("linear-gelu mlp", nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)), torch.randn(8, 16), False),
    ("layer norm", nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)), torch.randn(8, 16), False),
    ("layer norm, input only", frozen(nn.LayerNorm(16)), torch.randn(8, 16, requires_grad=True), False),
    ("lean custom function", Apply(Tanh), torch.randn(8, 32), True),
])
def test_passes_on_clean_models(name, model, inputs, verify):
    report = gradaudit.assert_no_waste(model, inputs, verify=verify)
    assert report.saved_bytes > 0  # something was audited


def test_works_on_the_meta_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), frozen(nn.Conv2d(8, 4, 3)))
        images = torch.empty(2, 3, 16, 16)
    with pytest.raises(AssertionError, match="12544 bytes"):  # 2*8*14*14*4, as on CPU
        gradaudit.assert_no_waste(model, images)


def test_example_user_test_file_shows_the_failure_text():
    folder = os.path.join(ROOT, "examples", "no_waste")
    result = subprocess.run([sys.executable, "-m", "pytest", "check_layer.py", "-p", "no:cacheprovider",
                             "-q", "--rootdir", folder], cwd=folder, capture_output=True, text=True,
                            timeout=300)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "1 failed, 2 passed" in out
    assert "FAILED check_layer.py::test_regressed_layer_is_caught" in out
    # 16 x 256 float32 = 16384 bytes: the input of the squared ReLU, never read by its backward
    assert ("E       AssertionError: gradaudit: FeedForward: 16 KiB (16384 bytes) held for backward could be "
            "freed: 16 KiB by dropping saves whose values backward never reads; 1 waste finding") in out
    assert "GA000 unexplained-unneeded-save" in out and "layer.py:" in out
    assert "SquaredReLUSavingInputBackward" in out
    assert "def assert_no_waste" not in out  # the traceback stops at the user's test line


def test_plugin_fixtures_are_registered_through_the_entry_point(tmp_path):
    (tmp_path / "test_user.py").write_text(
        "import torch\n"
        "from torch import nn\n\n"
        "def test_clean(no_waste, gradaudit_audit):\n"
        "    report = no_waste(nn.Linear(4, 4), torch.randn(2, 4))\n"
        "    assert gradaudit_audit(nn.Linear(4, 4), torch.randn(2, 4)).saved_bytes == report.saved_bytes\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "test_user.py", "-p", "no:cacheprovider", "-q"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_loading_the_plugin_does_not_import_torch():
    # pytest loads the plugin in every test run of an environment where gradaudit is installed;
    # unrelated test suites must not pay for (or break on) importing torch.
    import subprocess
    import sys

    code = ("import sys, gradaudit, gradaudit.pytest_plugin; "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "assert callable(gradaudit.audit) and 'torch' in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_gradaudit_never_imports_the_trainer_libraries():
    # the trainer callbacks are optional extras: importing gradaudit, its integrations package, auditing,
    # trimming and planning must not import transformers or lightning (slow, and maybe not installed)
    import subprocess
    import sys

    code = ("import sys, torch, gradaudit, gradaudit.integrations, gradaudit.integrations.session; "
            "m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(2)]); "
            "x = torch.randn(2, 4); "
            "gradaudit.audit(m, x); gradaudit.trim(m).remove(); gradaudit.plan(m, x, 1 << 20, measure_peak=False); "
            "loaded = sorted(n for n in sys.modules if n.split('.')[0] in ('transformers', 'lightning', "
            "'pytorch_lightning')); assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_assert_no_waste_checks_for_a_cuda_target_on_meta():
    # eval-mode batch norm behind a frozen convolution, as cuDNN would run it on a GPU: its input is
    # held only for a weight gradient nobody wants (GA201), on the CudnnBatchNormBackward0 node
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    model[1].requires_grad_(False)
    x = torch.randn(2, 3, 16, 16, device="meta")
    with pytest.raises(AssertionError, match="GA201"):
        gradaudit.assert_no_waste(model, x, target="cuda", allow=["GA4"])
    report = gradaudit.assert_no_waste(model, x, target="cuda", allow=["GA2", "GA4"])
    assert report.target == "cuda" and any(n.name == "CudnnBatchNormBackward0" for n in report.nodes)
