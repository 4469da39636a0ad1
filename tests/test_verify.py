"""The empirical proof (verify=True): verdicts, safety around checkpoints, RNG and the meta device."""

import pytest
import torch
from torch import nn

import gradaudit
from gradaudit.records import NEEDED, NOT_NEEDED, SIGN_ONLY
from tests.fixtures.functions import FailsAlone, LinearThen, SavesZerosAndSparse
from tests.fixtures.rule_models import CustomFunctionWaste, FrozenConvStack
from tests.rule_harness import audit_fixture


def by_attr(report, node):
    return {t.attr: t for t in report.held_tensors if t.node == node}


def test_proof_confirms_frozen_conv_stack():
    report = audit_fixture(FrozenConvStack, verify=True)
    assert report.verified and not report.notes
    conv = {t.attr: t for t in report.held_tensors if t.module == "conv"}
    assert (conv["input"].verdict, conv["input"].proven) == (NOT_NEEDED, True)
    # the weight is a parameter, alive anyway: left unproven (no byte figure depends on it)
    assert (conv["weight"].verdict, conv["weight"].proven) == (NEEDED, False)
    relu = by_attr(report, "ReluBackward0")["result"]
    assert (relu.verdict, relu.proven, relu.bitpackable) == (SIGN_ONLY, True, True)
    pool = by_attr(report, "MaxPool2DWithIndicesBackward0")
    assert pool["self"].verdict == NOT_NEEDED and pool["result1"].verdict == NEEDED and pool["result1"].proven


def test_custom_function_unused_save_is_proven_and_reported():
    report = audit_fixture(CustomFunctionWaste, verify=True)
    saves = by_attr(report, "_SavesTooMuchBackward")
    assert saves["saved_tensors[0]"].verdict == NEEDED  # x feeds the weight gradient
    assert saves["saved_tensors[2]"].verdict == NOT_NEEDED and saves["saved_tensors[2]"].proven
    # exp(x) is 4x8 float32 = 128 bytes, read by nobody
    assert report.reclaimable_bytes == 4 * 8 * 4


def test_proof_overrides_a_wrong_static_verdict(monkeypatch):
    from gradaudit.knowledge import Declaration, Read, Reads, registry

    wrong = Declaration("TanhBackward0", edges=("self",), saves={},
                        default=Read(reads=Reads.NOTHING, rule="GA000", unread="deliberately wrong"))
    monkeypatch.setitem(registry._DECLARED, "TanhBackward0", [wrong])
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2).requires_grad_(False))
    static = gradaudit.audit(model, torch.randn(3, 4))
    assert by_attr(static, "TanhBackward0")["result"].verdict == NOT_NEEDED  # the wrong claim
    # GA000 reports only proven saves: no finding, so no figure counts the 3x4 float32 (48 bytes);
    # a note says what the claim would free
    assert static.reclaimable_bytes == 0 and not static.findings
    assert any(n.startswith(f"{3 * 4 * 4} bytes more would be freed") and "GA000" in n for n in static.notes)
    proven = gradaudit.audit(model, torch.randn(3, 4), verify=True)
    tanh = by_attr(proven, "TanhBackward0")["result"]
    assert tanh.verdict == NEEDED and tanh.proven
    assert proven.reclaimable_bytes == 0
    (refuted,) = proven.disagreements
    assert (refuted.node, refuted.attr, refuted.static, refuted.proven) == ("TanhBackward0", "result", NOT_NEEDED, NEEDED)


def test_checkpointed_saves_are_never_unpacked():
    recomputed = []
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    block.register_forward_hook(lambda *a: recomputed.append(1))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False))

    report = gradaudit.audit(Model(), torch.randn(4, 8), verify=True)
    assert recomputed == [1]  # the forward only: no recomputation
    held = [t for t in report.tensors if t.managed_by == "checkpoint"]
    assert held and not any(t.proven for t in held)


def test_user_rng_untouched_and_meta_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.ReLU())
    x = torch.randn(2, 4)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    gradaudit.audit(model, x, verify=True)
    assert torch.equal(torch.rand(3), expected)
    with torch.device("meta"):
        meta_model = nn.Linear(4, 4)
    with pytest.raises(gradaudit.GradauditError, match="meta"):
        gradaudit.audit(meta_model, torch.randn(2, 4, device="meta"), verify=True)


def test_integer_saves_only_see_in_range_values():
    # max-pool indices and embedding ids are proven with their own min/max only (no heap damage)
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.pool = nn.MaxPool2d(2)

        def forward(self, ids):
            h = self.embed(ids % 10)  # ids computed here: an activation, so it is proven
            return self.pool(h.unsqueeze(0))

    report = gradaudit.audit(Model(), torch.tensor([[1, 19, 3, 3]]), verify=True)
    indices = by_attr(report, "MaxPool2DWithIndicesBackward0")["result1"]
    assert (indices.verdict, indices.proven) == (NEEDED, True)
    ids = by_attr(report, "EmbeddingBackward0")["indices"]
    assert (ids.verdict, ids.proven) == (NEEDED, True)


def test_backward_that_fails_alone_keeps_static_verdict():
    report = gradaudit.audit(LinearThen(FailsAlone, features=4), torch.randn(2, 4), verify=True)
    save = by_attr(report, "FailsAloneBackward")["saved_tensors[0]"]
    assert save.verdict == "unknown" and not save.proven and save.unproven


def test_backward_writing_into_a_shared_poison_is_proven_again_with_copies(monkeypatch):
    # Poisons and incoming gradients are views of shared pools (filled once per dtype). A built-in
    # backward never writes into them; if one did, its node is proven again with private copies
    # and the pools are refilled, so later nodes still get NaN where NaN is promised.
    from gradaudit import verify

    calls = {"fresh": 0, "shared": 0}

    class Scribbler:
        """Tanh's backward node, made to write into the gradient it is given."""

        def __init__(self, node, call):
            self.node, self.call = node, call

        def __getattr__(self, name):
            return getattr(self.node, name)

        def __call__(self, *grads):
            calls["fresh" if self.call.copies else "shared"] += 1
            grads[0].mul_(2)  # an in-place write into what the backward was given
            return self.node(*grads)

    original = verify.NodeCall.__init__

    def wrapping(self, node, *args, **kwargs):
        original(self, node, *args, **kwargs)
        if node.name() == "TanhBackward0":
            self.node = Scribbler(node, self)

    monkeypatch.setattr(verify.NodeCall, "__init__", wrapping)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.ReLU())
    report = gradaudit.audit(model, torch.randn(3, 4), verify=True)
    assert calls["shared"] == 1 and calls["fresh"] >= 2  # detected at the first call, then copies
    tanh = by_attr(report, "TanhBackward0")["result"]
    assert (tanh.verdict, tanh.proven) == (NEEDED, True) and not report.notes
    relu = by_attr(report, "ReluBackward0")["result"]
    assert (relu.verdict, relu.proven) == (SIGN_ONLY, True)


def test_poisons_keep_shape_strides_and_differ_everywhere():
    from gradaudit.verify import Poisons, Pools

    pools = Pools(torch.Generator().manual_seed(0))
    poisons = Poisons(pools)
    t = torch.randn(2, 3, 5, 4).to(memory_format=torch.channels_last)
    nan, rand = poisons.pair(t)
    shifted = poisons.pair(t, offset=1)[1]
    for p in (nan, rand, shifted):
        assert p.shape == t.shape and p.stride() == t.stride() and p.dtype == t.dtype
    assert nan.isnan().all() and rand.isfinite().all() and (rand != shifted).all()
    (sign,) = poisons.signs(torch.tensor([-2.0, 0.0, 3.0]))
    assert torch.equal(torch.sign(sign), torch.tensor([-1.0, 0.0, 1.0]))


def test_only_edges_computes_one_gradient_and_runs_no_hooks():
    # The fact narrowed proofs rest on: inside a graph task, a built-in backward computes only
    # the gradients whose edge functions are in that task's plan; only_edges() arranges that
    # without running anything of the audited graph but the node itself (no hooks, no .grad).
    from gradaudit.verify import only_edges

    ran = []
    conv = nn.Conv2d(3, 4, 3)
    conv.weight.register_hook(lambda g: ran.append("weight hook"))
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    y = conv(x * 1.0)
    y.register_hook(lambda g: ran.append("output hook"))
    node, grad = y.grad_fn, torch.randn(2, 4, 4, 4)
    full = node(grad)
    narrowed = only_edges(node, (1,), lambda: node(grad))
    assert all(g is not None for g in full)
    assert narrowed[0] is None and narrowed[2] is None and torch.equal(narrowed[1], full[1])
    assert ran == [] and conv.weight.grad is None and x.grad is None


def _verdicts(report):
    return [(t.node, t.attr, t.verdict, t.proven, t.bitpackable) for t in report.tensors]


def test_narrowed_proof_agrees_with_the_full_one(monkeypatch):
    from gradaudit import verify

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))
    x = torch.randn(2, 3, 8, 8)
    narrowed = gradaudit.audit(model, x, verify=True)
    monkeypatch.setattr(verify.Narrowing, "works", False)
    full = gradaudit.audit(model, x, verify=True)
    assert _verdicts(narrowed) == _verdicts(full) and not narrowed.notes
    saved = {(t.module, t.attr): t for t in narrowed.held_tensors}
    # activations proven "needed" by one weight gradient computed alone
    for key in [("2", "input"), ("3", "input"), ("3", "result2"), ("6", "mat1")]:
        assert (saved[key].verdict, saved[key].proven) == (NEEDED, True), key


def test_a_wrong_read_by_hint_costs_time_not_verdicts(monkeypatch):
    from gradaudit.knowledge.registry import Declaration

    # the bias gradient reads neither the input nor the weight: the narrowed witness shows no
    # change, and the full proof that follows still settles the verdict
    monkeypatch.setattr(Declaration, "witness_edges",
                        lambda self, attr, mask: (2,) if self.name == "ConvolutionBackward0" else None)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    report = gradaudit.audit(model, torch.randn(2, 3, 8, 8), verify=True)
    second = [t for t in report.held_tensors if t.module == "2" and t.attr == "input"]
    assert [(t.verdict, t.proven) for t in second] == [(NEEDED, True)] and not report.notes


def test_saves_no_poison_can_reach_stay_unproven():
    # An all-zero integer tensor has no in-range value of its own to differ from, and a sparse
    # save is not poisoned: neither may be reported "proven" without a call that shows it.
    report = gradaudit.audit(LinearThen(SavesZerosAndSparse), torch.randn(2, 3), verify=True)
    saves = by_attr(report, "SavesZerosAndSparseBackward")
    zeros, sparse = saves["saved_tensors[0]"], saves["saved_tensors[1]"]
    assert not zeros.proven and "no in-range value" in zeros.unproven
    assert not sparse.proven and "layout" in sparse.unproven


class _NoisyBackward(torch.autograd.Function):
    """Saves its input and never reads it; its backward adds noise of the global RNG's, as a
    GPU kernel that adds with atomics differs from call to call in the last bits."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.exp())
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2 + torch.rand_like(grad) * 1e-6


class _NoisyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return _NoisyBackward.apply(self.linear(x)).sum()


def test_a_backward_that_differs_from_call_to_call_proves_nothing():
    """A node whose backward gives a different result each call (a nondeterministic kernel) would
    change under any poison: the proof leaves its save unproven and says why, instead of calling
    it read (on an H200, every save of a compiled ResNet-18's cuDNN backward came out "needed").
    The proof's calls run with cuDNN's deterministic algorithms and the user's setting comes back."""
    torch.manual_seed(0)
    before = torch.backends.cudnn.deterministic
    report = gradaudit.audit(_NoisyModel(), torch.randn(3, 4), verify=True)
    assert torch.backends.cudnn.deterministic == before
    (save,) = by_attr(report, "_NoisyBackwardBackward").values()
    assert not save.proven and save.verdict != NEEDED
    assert "nondeterministic" in save.unproven and "use_deterministic_algorithms" in save.unproven
    # a deterministic read is still proven read
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2).requires_grad_(False))
    tanh = by_attr(gradaudit.audit(model, torch.randn(3, 4), verify=True), "TanhBackward0")["result"]
    assert tanh.verdict == NEEDED and tanh.proven
