"""Models that manage their saved tensors themselves: checkpointing, offloading, user hooks.

Their saves are reported as recomputed / offloaded / hook-managed, never as held, the audit never
triggers a recomputation, and their machinery keeps working afterwards.
"""

import inspect

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

import gradaudit
from gradaudit.measure import held_bytes_after_forward
from gradaudit.sites import short_path
from gradaudit.report.text import render as render_text
from conftest import hf_checkpointing


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
        h = ckpt.checkpoint(self.block, h, use_reentrant=self.reentrant)  # CHECKPOINT_LINE
        return self.post(h)


def _line_of(function, marker):
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, text in enumerate(lines) if marker in text)


CHECKPOINT_LINE = _line_of(Checkpointed.forward, "# CHECKPOINT_LINE")


def _held_in(report, prefix):
    return [t for t in report.held_tensors if t.module.startswith(prefix)]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_block_runs_once_and_is_not_held(reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    x = torch.randn(4, 8)
    report = gradaudit.audit(model, x)
    assert model.block.calls == 1  # the audit never recomputes
    # nothing inside the block is held by autograd; what is held in its name is the input the
    # checkpoint keeps to recompute it (non-reentrant: saved by the checkpoint itself, out of the
    # graph's reach; reentrant: CheckpointFunctionBackward's saved_tensors), needed, never "unknown"
    kept, = _held_in(report, "block")
    assert (kept.node, kept.attr) == (("CheckpointFunctionBackward", "saved_tensors[0]") if reentrant
                                      else ("CheckpointInputs", "inputs[0]"))
    assert (kept.module, kept.module_class, kept.shape) == ("block", "Block", (4, 8))
    assert kept.verdict == "needed" and "checkpoint" in kept.reason and kept.held
    assert kept.source == f"{short_path(__file__)}:{CHECKPOINT_LINE}"  # the checkpoint call
    assert report.summary()["unknown_tensors"] == 0
    if not reentrant:
        inner = [t for t in report.tensors if t.managed_by == "checkpoint"]
        # Block saves: addmm's mat1 (the block input) and mat2 (weight), tanh's result
        assert {t.node for t in inner} == {"AddmmBackward0", "TanhBackward0"}
        assert all(t.storage_id == -1 for t in inner)
        assert any("checkpoint" in note for note in report.notes)
    # held: sigmoid's result (4*8*4 = 128, also what the checkpoint keeps as the block input) and
    # post's mat1, the block output (128)
    assert report.saved_bytes == 256 == held_bytes_after_forward(model, x)
    model.block.calls = 1

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
    hf_checkpointing(model)
    model.train()
    counts, handles = _hf_count_layer_calls(
        [layer.self_attn if family == "llama" else layer.attention for layer in layers])
    report = gradaudit.audit(model, {"input_ids": ids})
    assert counts["n"] == len(layers)  # each layer ran once
    prefix = "model.layers" if family == "llama" else "encoder.layer"
    # all a layer holds is what its checkpoint keeps to recompute it: the hidden states (2x16x32)
    # and, for Llama, the keyword arguments Hugging Face binds into the checkpointed function
    # (functools.partial(layer.__call__, **kwargs)), which the checkpoint holds by plain reference:
    # the rotary cos and sin (1x16x8, head_dim 32/4) and the position ids (1x16, int64)
    kept = {(2, 16, 32)} | ({(1, 16, 8), (1, 16)} if family == "llama" else set())
    assert {(t.node, t.module, t.shape, t.verdict) for t in _held_in(report, prefix) if t.managed_by == "autograd"} \
        == {("CheckpointInputs", f"{prefix}.{i}", shape, "needed") for i in range(len(layers)) for shape in kept}
    assert any(t.managed_by == "checkpoint" for t in report.tensors)
    assert report.saved_bytes < plain.saved_bytes
    out = model(input_ids=ids)
    first = out.logits if family == "llama" else out.last_hidden_state
    first.float().pow(2).mean().backward()
    for h in handles:
        h.remove()
    assert counts["n"] == 2 * len(layers) + len(layers)  # audit + forward + one recomputation each
    assert all(p.grad is not None for p in layers[0].parameters())
    assert report.saved_bytes == held_bytes_after_forward(model, {"input_ids": ids})


# -- what checkpointing holds, and which parameters a reentrant checkpoint reaches -------------------


class CheckpointedResNet(nn.Module):
    """torchvision's resnet18 with every BasicBlock run through torch.utils.checkpoint."""

    def __init__(self, net, reentrant):
        super().__init__()
        self.net = net
        self.reentrant = reentrant

    def forward(self, x):
        n = self.net
        h = n.maxpool(n.relu(n.bn1(n.conv1(x))))
        for layer in (n.layer1, n.layer2, n.layer3, n.layer4):
            for block in layer:
                h = ckpt.checkpoint(block, h, use_reentrant=self.reentrant)  # RESNET_CHECKPOINT
        return n.fc(torch.flatten(n.avgpool(h), 1))


# the block inputs resnet18 keeps for a 2x3x32x32 batch: the stem halves 32 twice (conv1 stride 2,
# max-pool) to 8x8; layer2..4 halve it again. Each block's input, float32:
#   layer1.0, layer1.1, layer2.0: 2x64x8x8   = 2*64*64*4  = 32768 bytes each
#   layer2.1, layer3.0:           2x128x4x4  = 2*128*16*4 = 16384 each
#   layer3.1, layer4.0:           2x256x2x2  = 2*256*4*4  = 8192 each
#   layer4.1:                     2x512x1x1  = 2*512*4    = 4096
RESNET_BLOCK_INPUTS = {
    "net.layer1.0": ((2, 64, 8, 8), 32768), "net.layer1.1": ((2, 64, 8, 8), 32768),
    "net.layer2.0": ((2, 64, 8, 8), 32768), "net.layer2.1": ((2, 128, 4, 4), 16384),
    "net.layer3.0": ((2, 128, 4, 4), 16384), "net.layer3.1": ((2, 256, 2, 2), 8192),
    "net.layer4.0": ((2, 256, 2, 2), 8192), "net.layer4.1": ((2, 512, 1, 1), 4096),
}
assert sum(nbytes for _, nbytes in RESNET_BLOCK_INPUTS.values()) == 3 * 32768 + 2 * 16384 + 2 * 8192 + 4096 == 151552


def _checkpointed_resnet(torchvision, reentrant):
    torch.manual_seed(0)
    return CheckpointedResNet(torchvision.models.resnet18(num_classes=10), reentrant).train(), torch.randn(2, 3, 32, 32)


def _without_gradient(model):
    """Modules with a trainable parameter that a real backward leaves without a (non-zero) gradient."""
    return {name.rpartition(".")[0] for name, p in model.named_parameters()
            if p.requires_grad and (p.grad is None or not p.grad.abs().sum())}


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_hold_their_inputs_in_their_own_name(torchvision, reentrant):
    """The inputs a checkpoint keeps are held memory, attributed to the checkpointed block, with a
    verdict: never an anonymous "CopySlices hidden[i]" of no module and no verdict."""
    model, x = _checkpointed_resnet(torchvision, reentrant)
    report = gradaudit.audit(model, x)
    line = f"{short_path(__file__)}:{_line_of(CheckpointedResNet.forward, '# RESNET_CHECKPOINT')}"
    node = "CheckpointFunctionBackward" if reentrant else "CheckpointInputs"
    kept = [t for t in report.tensors if t.node == node]
    assert {t.module: (t.shape, t.view_nbytes) for t in kept} == RESNET_BLOCK_INPUTS
    assert all(t.held and t.verdict == "needed" and "recompute" in t.reason and t.module_class == "BasicBlock"
               and t.source == line for t in kept)
    assert sum(t.view_nbytes for t in kept) == 151552
    assert not [t for t in report.tensors if t.node == "CopySlices" or t.attr.startswith("hidden")]
    assert report.summary()["unknown_tensors"] == 0 and report.unexplained == []
    # held memory: the independent measurement agrees to the byte
    assert report.saved_bytes == held_bytes_after_forward(model, x)
    assert "--verify proves" not in render_text(report)


def test_reentrant_checkpoint_after_a_trainable_stem_gives_no_ga901(torchvision):
    """The stem trains, so every block's input requires grad: backward reruns each block and
    gives every conv and batch norm inside a gradient. GA901 must not say otherwise."""
    model, x = _checkpointed_resnet(torchvision, reentrant=True)
    report = gradaudit.audit(model, x)
    assert [f for f in report.findings if f.code == "GA901"] == []
    model(x).sum().backward()
    assert _without_gradient(model) == set()


def test_reentrant_checkpoint_after_a_frozen_stem_gets_ga901_exactly_where_true(torchvision):
    """Frozen stem: no block input requires grad, the checkpoints' outputs do not either, and no
    parameter inside a block gets a gradient. GA901 names exactly those modules, at the call."""
    model, x = _checkpointed_resnet(torchvision, reentrant=True)
    model.net.conv1.requires_grad_(False)
    model.net.bn1.requires_grad_(False)
    report = gradaudit.audit(model, x)
    flagged = [f for f in report.findings if f.code == "GA901"]
    line = f"{short_path(__file__)}:{_line_of(CheckpointedResNet.forward, '# RESNET_CHECKPOINT')}"
    assert {f.source for f in flagged} == {line}
    assert all("use_reentrant=True" in f.message and f.module_class in ("Conv2d", "BatchNorm2d") for f in flagged)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        model(x).sum().backward()
    # 8 blocks x (conv1, bn1, conv2, bn2) + 3 downsample (conv, bn) pairs = 38 modules
    assert {f.module for f in flagged} == _without_gradient(model) and len(flagged) == 38


def test_reentrant_checkpoint_over_a_closure_reaches_the_modules_it_runs():
    """``checkpoint(custom_forward, h)`` with the modules reached through a closure: the modules
    that ran inside and the closure's parameters get gradients; a module that never ran does not."""

    class Closure(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(4, 4)
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            def custom_forward(t):
                return self.b(self.a(t)) * self.scale
            return ckpt.checkpoint(custom_forward, self.stem(x), use_reentrant=True)

    torch.manual_seed(0)
    model, x = Closure(), torch.randn(2, 4)
    report = gradaudit.audit(model, x)
    assert {f.module for f in report.findings if f.code == "GA901"} == {"unused"}
    unused, = [f for f in report.findings if f.code == "GA901"]
    assert unused.module_class == "Linear" and unused.source is None  # no checkpoint to blame
    model(x).sum().backward()
    assert _without_gradient(model) == {"unused"}


def test_verify_never_reruns_a_reentrant_block():
    torch.manual_seed(0)
    model = Checkpointed(reentrant=True)
    report = gradaudit.audit(model, torch.randn(4, 8), verify=True)
    assert model.block.calls == 1
    kept, = _held_in(report, "block")
    assert kept.verdict == "needed" and not kept.proven and "recompute" in kept.unproven


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_hf_reentrant_checkpointing_gives_no_false_ga901(family, tiny_hf_model):
    """transformers' reentrant checkpointing (it makes the embeddings' output require grad): every
    layer's parameters get gradients, GA901 stays silent, and each layer's checkpoint input is
    held in the layer's name."""
    model = tiny_hf_model(family)
    hf_checkpointing(model, use_reentrant=True)
    model.train()
    ids = torch.randint(0, 100, (2, 16))
    report = gradaudit.audit(model, {"input_ids": ids})
    assert [f for f in report.findings if f.code == "GA901"] == []
    prefix, layers = ("model.layers", model.model.layers) if family == "llama" else ("encoder.layer", model.encoder.layer)
    kept = {(t.module, t.shape, t.verdict) for t in report.held_tensors if t.node == "CheckpointFunctionBackward"}
    assert kept == {(f"{prefix}.{i}", (2, 16, 32), "needed") for i in range(len(layers))}
    out = model(input_ids=ids)
    (out.logits if family == "llama" else out.last_hidden_state).float().pow(2).mean().backward()
    assert all(p.grad is not None for layer in layers for p in layer.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True])
def test_peft_lora_with_hf_checkpointing_and_autocast_equals_the_tracker(tiny_hf_model, autocast):
    # a LoRA Llama trained the way peft's guides say (gradient checkpointing, inputs requiring
    # grad), with and without bfloat16 autocast around the forward: every byte the audit counts is
    # what the independent storage tracker finds alive after the forward (closure-held keyword
    # arguments of each checkpointed layer included)
    peft = pytest.importorskip("peft")
    model = tiny_hf_model("llama", use_cache=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    hf_checkpointing(model)
    model.enable_input_require_grads()
    model.train()

    class UnderAutocast(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                return self.inner(input_ids=ids).logits

    wrapped, ids = UnderAutocast(model), torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(0))
    report = gradaudit.audit(wrapped, ids)
    assert report.saved_bytes == held_bytes_after_forward(wrapped, ids)
    assert any(t.node == "CheckpointInputs" and t.shape == (1, 32) for t in report.held_tensors)  # position ids


def test_selective_checkpoint_cache_is_counted():
    # torch.utils.checkpoint with a selective policy keeps the outputs of the ops it saves in a
    # cache outside the graph: held until backward, seen by no saved-tensor hook
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def keep_matmuls(ctx, op, *args, **kwargs):
        keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            return x + self.b(torch.nn.functional.gelu(self.a(x)))

    class Stack(nn.Module):
        def __init__(self, selective):
            super().__init__()
            self.blocks, self.selective = nn.ModuleList([Block() for _ in range(3)]), selective

        def forward(self, x):
            for block in self.blocks:
                options = {"context_fn": functools.partial(create_selective_checkpoint_contexts, keep_matmuls)} \
                    if self.selective else {}
                x = ckpt.checkpoint(block, x, use_reentrant=False, **options)
            return x

    torch.manual_seed(0)
    x = torch.randn(16, 32, requires_grad=True)
    plain, selective = gradaudit.audit(Stack(False), x), gradaudit.audit(Stack(True), x)
    # plain: the inputs of blocks 1 and 2 (block 0's is the caller's): 2 x 16x32 float32 = 4096 B
    assert plain.saved_bytes == 4096 == held_bytes_after_forward(Stack(False), x)
    # selective: also each block's two linear outputs, 16x64 and 16x32 float32 = 6144 B, three times
    assert selective.saved_bytes == 4096 + 3 * 6144 == held_bytes_after_forward(Stack(True), x)
    cached = [t for t in selective.held_tensors if t.attr.startswith("cached[")]
    assert sorted(t.shape for t in cached) == [(16, 32)] * 3 + [(16, 64)] * 3
    assert all(t.verdict == "needed" and t.node == "CheckpointInputs" for t in cached)
