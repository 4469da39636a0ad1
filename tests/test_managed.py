"""Models that manage their saved tensors themselves: checkpointing, offloading, user hooks.

Their saves are reported as recomputed / offloaded / hook-managed, never as held, the audit never
triggers a recomputation, and their machinery keeps working afterwards.
"""

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

import gradaudit


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.block = Block()
        self.post = nn.Linear(8, 8)
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.sigmoid(self.pre(x))
        h = ckpt.checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.post(h)


def _held_in(report, prefix):
    return [t for t in report.held_tensors if t.module.startswith(prefix)]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_block_runs_once_and_is_not_held(reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    x = torch.randn(4, 8)
    report = gradaudit.audit(model, x)
    assert model.block.calls == 1  # the audit never recomputes
    # nothing inside the block is held by autograd
    assert _held_in(report, "block") == []
    if not reentrant:
        inner = [t for t in report.tensors if t.managed_by == "checkpoint"]
        # Block saves: addmm's mat1 (the block input) and mat2 (weight), tanh's result
        assert {t.node for t in inner} == {"AddmmBackward0", "TanhBackward0"}
        assert all(t.storage_id == -1 for t in inner)
        assert any("checkpoint" in note for note in report.notes)
    # held: sigmoid's result (4*8*4 = 128, also what the checkpoint keeps as the block input) and
    # post's mat1, the block output (128)
    assert report.saved_bytes == 256

    # backward still works afterwards, recomputing once, with the user's hooks firing
    seen = []
    # a pre-hook: the non-reentrant recomputation stops as soon as the last save is redone, so the
    # block's post-forward hooks do not run again (torch's behaviour, with or without gradaudit)
    handle = model.block.register_forward_pre_hook(lambda m, a: seen.append("forward"))
    x.requires_grad_(True)
    x.register_hook(lambda g: seen.append("grad"))
    model(x).sum().backward()
    handle.remove()
    assert model.block.calls == 3  # one plain forward + one recomputation
    assert seen.count("forward") == 2 and seen.count("grad") == 1
    assert model.block.lin.weight.grad is not None and x.grad is not None


def test_save_on_cpu_is_reported_as_offloaded():
    model = Block()
    x = torch.randn(4, 8, requires_grad=True)

    class Offloading(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, v):
            with torch.autograd.graph.save_on_cpu():
                return self.inner(v)

    report = gradaudit.audit(Offloading(), x)
    offloaded = [t for t in report.tensors if t.managed_by == "offload"]
    # addmm saves mat1 (x) and mat2 (weight.t()), tanh its result
    assert len(offloaded) == 3 and report.held_tensors == []
    assert report.saved_bytes == 0
    assert {t.shape for t in offloaded} == {(4, 8), (8, 8)}
    assert report.offloaded_bytes == 3 * 4 * 8 * 4 - 4 * 8 * 4 + 8 * 8 * 4  # 2*128 + 256 = 512


def test_user_saved_tensor_hooks_are_reported_as_hooks():
    unpacked = []

    class Compress(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            def pack(t):
                return ("mine", t.to(torch.float16))

            def unpack(box):
                unpacked.append(1)
                return box[1].to(torch.float32)

            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return torch.tanh(self.lin(x))

    model = Compress()
    x = torch.randn(4, 8, requires_grad=True)
    report = gradaudit.audit(model, x)
    assert unpacked == []  # the audit never ran the user's unpack
    managed = [t for t in report.tensors if t.managed_by == "hooks"]
    assert {t.node for t in managed} == {"AddmmBackward0", "TanhBackward0"}
    assert report.saved_bytes == 0
    model(x).sum().backward()
    assert len(unpacked) == 3  # mat1, mat2 (the weight's transpose) and tanh's result, each once
    assert x.grad is not None


def _hf_count_layer_calls(blocks):
    # counted on a child: HF's checkpointing layer reruns its forward without its own module hooks
    counts = {"n": 0}
    handles = [block.register_forward_pre_hook(lambda m, a: counts.__setitem__("n", counts["n"] + 1))
               for block in blocks]
    return counts, handles


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_hf_gradient_checkpointing(family, tiny_hf_model):
    model = tiny_hf_model(family)  # LlamaForCausalLM or BertModel
    layers = model.model.layers if family == "llama" else model.encoder.layer
    ids = torch.randint(0, 100, (2, 16))
    plain = gradaudit.audit(model.train(), {"input_ids": ids})
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    counts, handles = _hf_count_layer_calls(
        [layer.self_attn if family == "llama" else layer.attention for layer in layers])
    report = gradaudit.audit(model, {"input_ids": ids})
    assert counts["n"] == len(layers)  # each layer ran once
    prefix = "model.layers" if family == "llama" else "encoder.layer"
    assert not [t for t in _held_in(report, prefix) if t.managed_by == "autograd"]
    assert any(t.managed_by == "checkpoint" for t in report.tensors)
    assert report.saved_bytes < plain.saved_bytes
    out = model(input_ids=ids)
    first = out.logits if family == "llama" else out.last_hidden_state
    first.float().pow(2).mean().backward()
    for h in handles:
        h.remove()
    assert counts["n"] == 2 * len(layers) + len(layers)  # audit + forward + one recomputation each
    assert all(p.grad is not None for p in layers[0].parameters())
