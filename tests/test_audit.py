"""The Python API: how inputs are passed, the trainable what-if, and the JSON document."""

import json

import pytest
import torch
from torch import nn

import gradaudit
from gradaudit.errors import ForwardError, GradauditError, NothingRequiresGradError


class TwoArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(6, 5)

    def forward(self, x, y=None):
        out = torch.tanh(self.a(x))
        if y is not None:
            out = out + torch.tanh(self.b(y))
        return out


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(4 * 3 * 3, 2)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def _tanh_results(report):
    return sorted(t.module for t in report.held_tensors if t.node == "TanhBackward0")


def test_a_tensor_is_one_positional_argument():
    report = gradaudit.audit(TwoArgs(), torch.randn(3, 6))
    assert _tanh_results(report) == [""]  # one tanh: y was not passed
    assert report.saved_bytes == 3 * 5 * 4  # 60: the tanh result


def test_a_tuple_is_positional_arguments_and_a_dict_keyword_arguments():
    model = TwoArgs()
    x, y = torch.randn(3, 6), torch.randn(3, 6)
    by_tuple = gradaudit.audit(model, (x, y))
    by_dict = gradaudit.audit(model, {"x": x, "y": y})
    assert _tanh_results(by_tuple) == _tanh_results(by_dict) == ["", ""]
    assert by_tuple.saved_bytes == by_dict.saved_bytes == 2 * 3 * 5 * 4  # 120: two tanh results


def test_args_are_positional_and_keyword_arguments_together():
    """``gradaudit.Args(x, y=y)`` calls ``model(x, y=y)``: the same audit as the tuple's and the dict's,
    on the CPU and beside a meta model (its tensors moved to meta, as a tuple's are), and a fit's batch
    scales through it."""
    model = TwoArgs()
    x, y = torch.randn(3, 6), torch.randn(3, 6)
    mixed = gradaudit.audit(model, gradaudit.Args(x, y=y))
    assert _tanh_results(mixed) == ["", ""] and mixed.saved_bytes == 2 * 3 * 5 * 4  # 120, as by tuple
    with gradaudit.meta_device():
        on_meta = TwoArgs()
    assert gradaudit.audit(on_meta, gradaudit.Args(x, y=y)).saved_bytes == 120
    fitted = gradaudit.fit(model, gradaudit.Args(x, y=y), memory="1MiB")
    assert fitted.live.size_search.measure("batch", 6)[0] == gradaudit.fit(
        model, gradaudit.Args(torch.cat([x, x]), y=torch.cat([y, y])), memory="1MiB").peak_bytes
    assert repr(gradaudit.Args(1, y=2)) == "Args(1, y=2)"


def test_anything_else_is_one_positional_argument():
    class TakesList(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 5)

        def forward(self, items):
            return sum(torch.tanh(self.lin(t)) for t in items)

    report = gradaudit.audit(TakesList(), [torch.randn(3, 6), torch.randn(3, 6)])
    assert len(_tanh_results(report)) == 2
    # the tensors inside the list count as the caller's inputs (free)
    assert {t.storage_kind for t in report.held_tensors if t.node == "AddmmBackward0" and t.attr == "mat1"} == {"input"}


def test_trainable_globs_are_a_what_if_and_flags_are_restored():
    model = Stack().eval()
    model.head.requires_grad_(False)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    x = torch.randn(2, 3, 8, 8)
    report = gradaudit.audit(model, x, trainable=["head.*"])
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert report.parameters_requiring_grad == 2  # head.weight, head.bias
    # only the head trains: nothing before it needs a gradient, so only the head's input is saved
    assert {t.module for t in report.held_tensors} == {"head"}
    frozen_all_but_conv = gradaudit.audit(model, x, trainable=["features.0.*"], frozen=["features.0.bias"])
    assert frozen_all_but_conv.parameters_requiring_grad == 1
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before


def test_nothing_requiring_grad_is_an_error_that_says_what_to_do():
    model = Stack().requires_grad_(False)
    with pytest.raises(NothingRequiresGradError, match="trainable"):
        gradaudit.audit(model, torch.randn(2, 3, 8, 8))


def test_a_failing_forward_raises_forward_error_and_restores_flags():
    model = Stack()
    with pytest.raises(ForwardError, match="RuntimeError"):
        gradaudit.audit(model, torch.randn(2, 5, 8, 8), trainable=["head.*"])  # wrong channel count
    assert all(p.requires_grad for p in model.parameters())


def test_verify_on_meta_is_refused():
    with torch.device("meta"):
        model = Stack()
    with pytest.raises(GradauditError, match="meta"):
        gradaudit.audit(model, torch.randn(2, 3, 8, 8, device="meta"), verify=True)


def test_not_a_module_is_refused():
    with pytest.raises(GradauditError):
        gradaudit.audit(lambda x: x, torch.randn(2))


def test_json_document_shape():
    torch.manual_seed(0)
    model = Stack().eval()
    model.features.requires_grad_(False)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    report = gradaudit.audit(model, x)
    doc = json.loads(json.dumps(report.to_dict()))  # plain JSON types only
    assert doc["schema_version"] == gradaudit.SCHEMA_VERSION == 1
    summary = doc["summary"]
    for key in ("saved_bytes", "reclaimable_bytes", "reclaimable_with_bitpacking_bytes"):
        assert summary[key] == getattr(report, key)
    tensors = doc["tensors"]
    assert tensors and all({"node", "attr", "shape", "dtype", "nbytes", "module", "needed"} <= set(t) for t in tensors)
    conv_input = next(t for t in tensors if t["node"] == "ConvolutionBackward0" and t["attr"] == "input")
    assert conv_input["shape"] == [2, 3, 8, 8] and conv_input["dtype"] == "float32"
    assert conv_input["module"] == "features.0"
    # frozen weight: the input is not needed (but it is the caller's input, so it costs nothing)
    assert conv_input["needed"] is False and conv_input["storage_kind"] == "input"
    assert {True, False} <= {t["needed"] for t in tensors}
    relu = next(t for t in tensors if t["node"] == "ReluBackward0")
    assert relu["needed"] is True  # sign-only still means needed
    # an op no rule knows: needed is null
    unknown = [t for t in report.tensors if t.verdict == "unknown"]
    for t in unknown:
        assert doc["tensors"][t.index]["needed"] is None
    for f in doc["findings"]:
        assert {"code", "name", "module", "bytes", "message", "fix"} <= set(f)
    assert [f.code for f in report.findings] == [f["code"] for f in doc["findings"]]
    bn_input = next(t for t in report.tensors if t.node == "NativeBatchNormBackward0" and t.attr == "input")
    # BN in eval with a frozen affine does not need the conv output: 2*4*6*6*4 = 1152 bytes
    assert bn_input.verdict == "not-needed" and report.storages[bn_input.storage_id].nbytes == 1152
    assert any(f.code == "GA201" for f in report.findings)


def test_needed_is_null_for_unknown_ops():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return torch.atan2(x, self.w)  # no rule knows atan2

    report = gradaudit.audit(Odd(), torch.randn(3, 4))
    doc = report.to_dict()
    atan2 = [t for t in doc["tensors"] if t["node"] == "Atan2Backward0"]
    assert atan2 and all(t["needed"] is None for t in atan2)
    assert report.summary()["unknown_tensors"] == len(atan2)
    # its saves are the caller's input and a parameter: free, so not listed as a blind spot
    assert sorted(t["storage_kind"] for t in atan2) == ["input", "parameter"]
    assert not any(u["node"] == "Atan2Backward0" for u in doc["unexplained"])


def test_without_a_node_creation_hook_saves_are_attributed_at_pack_time(monkeypatch):
    # torch 2.13 has no node-creation hook: the recorder falls back to the module running when
    # each tensor is packed. Same modules, same bytes.
    torch.manual_seed(0)
    model = Stack().train()
    x = torch.randn(2, 3, 8, 8)
    with_hook = gradaudit.audit(model, x)
    from gradaudit import torchapi

    monkeypatch.setitem(torchapi.FEATURES, "node creation hook", False)  # as on a torch without it
    without = gradaudit.audit(model, x)
    assert [(t.node, t.attr, t.module, t.module_class) for t in without.tensors] == [
        (t.node, t.attr, t.module, t.module_class) for t in with_hook.tensors]
    assert without.saved_bytes == with_hook.saved_bytes
    assert {t.module for t in without.held_tensors} >= {"features.0", "features.1", "features.2", "head"}


def test_sparse_save_is_uncounted_not_zero():
    # A sparse save has no single storage: the audit does not crash, puts it in no byte figure
    # and says so; the independent tracker counts its index and value tensors.
    from gradaudit.measure import held_bytes_after_forward
    from gradaudit.report.text import render

    from tests.fixtures.functions import LinearThen, SavesSparse

    model, x = LinearThen(SavesSparse), torch.randn(2, 3)
    report = gradaudit.audit(model, x)
    assert report.summary()["uncounted_tensors"] == 1 and report.saved_bytes == 0
    assert "size is unknown" in render(report)
    # 2x3 dense values, all nonzero: indices 2 x 6 int64 (96 B) + values 6 float32 (24 B)
    assert held_bytes_after_forward(model, x) == 2 * 6 * 8 + 6 * 4


def test_young_only_measurement_matches_a_full_collection(tiny_hf_model):
    """audit() measures the forward without attention dropout collecting only the objects made
    since that forward began (a full collection costs more than a small forward): same bytes,
    also when the output sits in a reference cycle, and nothing left frozen."""
    import gc

    from gradaudit.measure import held_bytes_after_forward
    from gradaudit.sdpa import WithoutAttentionDropout

    class Cyclic(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            box = {"y": self.fc(x).relu()}
            box["self"] = box  # the output is freed only by the cycle collector
            return box["y"]

    cases = [(tiny_hf_model("bert").train(), {"input_ids": torch.randint(0, 100, (2, 16))}),
             (Cyclic(), torch.randn(4, 8))]
    for model, inputs in cases:
        with WithoutAttentionDropout():
            full = held_bytes_after_forward(model, inputs)
            young = held_bytes_after_forward(model, inputs, young_only=True)
        assert young == full > 0
        assert gc.get_freeze_count() == 0


def test_an_audit_its_json_and_a_command_lines_build_collect_only_what_they_make():
    """audit, Report.to_dict and the command line's call of a model factory set the older objects aside
    from the collector while they run (gc.freeze: a full collection there looks at what they made, not
    at torch and the model), and put them back after: an old garbage cycle made before is kept through a
    collection inside and freed by the next one outside, a young one is collected as they begin; the
    figures are those of an audit under the caller's own freeze, which the audit leaves in force."""
    import gc
    import weakref

    from gradaudit.loading import call

    class Old:
        pass

    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            gc.collect()  # a full collection inside the audit: the cycle made before it survives
            seen.append((gc.get_freeze_count() > 0, cycle_alive()))
            return self.fc(x).relu()

    def made_cycle(old=True):
        made = Old()
        made.self = made
        if old:
            gc.collect()  # (alive through a full collection: among the oldest objects, then garbage)
        return weakref.ref(made)

    def cycle_alive():
        return ref() is not None

    audit = gradaudit.audit  # (imported now: an import's collections would find the cycle before the audit)
    gc.collect()
    model, x = Probe(), torch.randn(4, 8)
    ref = made_cycle()
    report = audit(model, x)
    assert seen == [(True, True)] and gc.get_freeze_count() == 0
    gc.collect()
    assert not cycle_alive()  # outside, the next full collection finds it
    ref = made_cycle(old=False)
    seen.clear()
    audit(model, x)
    assert seen == [(True, False)]  # collected as the audit began

    node_class = type(report.nodes[0])
    dumping = node_class.to_dict
    dumped = []
    node_class.to_dict = lambda node: dumped.append(gc.get_freeze_count() > 0) or dumping(node)
    try:
        document = report.to_dict()
    finally:
        node_class.to_dict = dumping
    assert dumped and all(dumped) and document == report.to_dict() and gc.get_freeze_count() == 0

    assert call(lambda: gc.get_freeze_count() > 0, "factory") is True
    assert gc.get_freeze_count() == 0

    gc.freeze()  # the caller's own: left as it is, the figures the same
    try:
        seen.clear()
        again = gradaudit.audit(model, x)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert seen == [(True, False)] and again.to_dict() == report.to_dict()
    # the ReLU's result, 4 x 8 fp32 (the Linear's saved input is the caller's tensor, alive anyway)
    assert again.saved_bytes == report.saved_bytes == 4 * 8 * 4


def test_blocks_nested_in_a_collecting_block_never_ask_how_much_is_frozen(monkeypatch):
    """gc.get_freeze_count walks every frozen object (~50 ms with an 80-layer model frozen): the outermost
    block asks once, before it freezes; the audits, plans and reports nested in it count themselves."""
    import gc

    from gradaudit import collecting

    asked = []
    counting = gc.get_freeze_count
    monkeypatch.setattr(collecting.gc, "get_freeze_count", lambda: asked.append(1) or counting())
    with collecting.collecting_only_new():
        report = gradaudit.audit(nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True))
        report.to_dict()
        with collecting.collecting_only_new():
            assert counting() > 0  # (the outer block's freeze, left as it is)
    assert asked == [1] and counting() == 0


def test_a_torchscript_module_is_refused_with_what_to_do():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated
        scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    with pytest.raises(GradauditError, match=r"^0 is a TorchScript module .*audit the module before scripting it"):
        gradaudit.audit(nn.Sequential(scripted), torch.randn(2, 4, requires_grad=True))
