"""gradaudit.plan: checkpointing chosen for a memory budget, exact to the byte, proven by re-audit."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import re

import pytest
import torch
from torch import nn

import gradaudit
from gradaudit.errors import GradauditError
from gradaudit.measure import held_bytes_after_forward
from gradaudit.planning import PLAN_SCHEMA_VERSION, BudgetError, plan, repeated_blocks, timing
from gradaudit.planning.solve import Block, Chain, cheapest_within, exhaustive, solve
from conftest import hf_checkpointing


def mlp_stack(n: int = 6, width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.Tanh())
                           for _ in range(n)])


def step(model: nn.Module, inputs, loss=lambda out: out.pow(2).sum()):
    """Gradients (of the parameters and of inputs that require grad) and buffers after one seeded
    forward and backward (dropout draws the same masks)."""
    model.zero_grad(set_to_none=True)
    leaves = {f"input.{k}": t for k, t in (inputs.items() if isinstance(inputs, dict) else [(0, inputs)])
              if isinstance(t, torch.Tensor) and t.requires_grad}
    for t in leaves.values():
        t.grad = None
    torch.manual_seed(5)
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    out = getattr(out, "logits", None) if hasattr(out, "logits") else getattr(out, "last_hidden_state", out)
    loss(out.float()).backward()
    grads = {n: p.grad.clone() for n, p in [*model.named_parameters(), *leaves.items()] if p.grad is not None}
    for t in leaves.values():
        t.grad = None
    return grads, {n: b.clone() for n, b in model.named_buffers()}


def assert_exact_and_identical(model: nn.Module, inputs, fraction: float, trainable=None,
                               cost="flops") -> gradaudit.Report:
    """Plan to ``fraction`` of the unplanned held bytes; the re-audit of the planned model holds
    exactly plan.held_bytes (and so does the independent storage tracker); one training step
    gives bit-identical gradients and buffers (batch-norm statistics) to the unplanned model."""
    unplanned = gradaudit.audit(model, inputs, trainable=trainable)
    budget = int(unplanned.saved_bytes * fraction)
    chosen = plan(model, inputs, budget, trainable=trainable, measure_peak=False, cost=cost)
    assert chosen.cost == cost
    assert chosen.unplanned_held_bytes == unplanned.saved_bytes
    assert chosen.held_bytes <= budget < unplanned.saved_bytes and chosen.checkpointed
    with chosen.apply(model):
        planned = gradaudit.audit(model, inputs, trainable=trainable)
    assert planned.saved_bytes == chosen.held_bytes
    if trainable is None:
        assert_step_held_and_identical(model, inputs, chosen)
    return planned


def assert_step_held_and_identical(model: nn.Module, inputs, chosen) -> None:
    """With ``chosen`` applied, the storage tracker holds exactly plan.held_bytes after the forward,
    and one training step gives gradients and buffers (batch-norm statistics) bit-identical to the
    plain step's; the model's state is put back after each step."""
    state = copy.deepcopy(model.state_dict())
    expected_grads, expected_buffers = step(model, inputs)
    model.load_state_dict(state)
    with chosen.apply(model):
        independent = held_bytes_after_forward(model, inputs)
        model.load_state_dict(state)  # (that forward updated batch-norm statistics)
        grads, buffers = step(model, inputs)
    model.load_state_dict(state)
    assert independent == chosen.held_bytes
    assert expected_grads and grads.keys() == expected_grads.keys()
    assert all(torch.equal(grads[k], expected_grads[k]) for k in grads)
    assert all(torch.equal(buffers[k], expected_buffers[k]) for k in buffers)


# -- the figures are exact --------------------------------------------------------------------------


def test_plan_of_a_sequential_stack_is_exact_and_minimal():
    model, x = mlp_stack(), torch.randn(32, 64)
    # block i saves its input (first Linear; block 0's is the caller's, free), its ReLU result r_i
    # (ReLU, and the second Linear's input) and its Tanh result t_i (Tanh; it is also block i+1's
    # input): 6 r + 6 t of 32x64 float32 = 12 * 8192 B (t_5 is the output, which TanhBackward holds)
    unplanned = gradaudit.audit(model, x).saved_bytes
    assert unplanned == 12 * 8192
    # checkpointing block i < 5 frees r_i only (t_i stays: block i+1 saves it, or holds it as its
    # input); block 5 frees r_5 and t_5 (no one else keeps the output) for the same recompute.
    # 3 * 8192 B less: block 5 and one other, two recomputed blocks
    chosen = plan(model, x, unplanned - 3 * 8192)
    assert chosen.held_bytes == 9 * 8192 and len(chosen.checkpointed) == 2 and "5" in chosen.checkpointed
    assert chosen.extra_flops == 2 * chosen.blocks[0]["flops"] > 0
    assert_exact_and_identical(model, x, 0.6)


def test_plan_on_resnet_in_train_mode_keeps_batch_norm_statistics(vision_model):
    model = vision_model("resnet18").train()
    assert_exact_and_identical(model, torch.randn(2, 3, 64, 64), 0.7)


def test_sqrt_n_segments_baseline_of_a_sequential_stack_is_measured():
    from gradaudit.planning import segments

    model, x = mlp_stack(16), torch.randn(32, 64)
    chosen = plan(model, x, 16 * 8192)
    baseline = next(b for b in chosen.baselines if b.name == "4 segments")
    # 16 blocks in 4 segments of 4 (checkpoint_sequential's split); segments 0-2 are checkpointed and
    # hold their inputs t_3, t_7, t_11 (x is the caller's), the last runs plainly and holds r and t
    # of blocks 12-15: 3 + 8 = 11 tensors of 32 x 64 float32 = 11 * 8192 B
    assert baseline.checkpointed == tuple(str(i) for i in range(12))
    assert baseline.held_bytes == 11 * 8192
    every = next(b for b in chosen.baselines if b.name == "every block")
    assert every.held_bytes == 15 * 8192  # t_0 .. t_14: every block's input but x, and t_15 (the output)
    assert baseline.extra_flops == 12 * chosen.blocks[0]["flops"]
    with segments.segmented(model, 4):
        assert gradaudit.audit(model, x).saved_bytes == held_bytes_after_forward(model, x) == baseline.held_bytes
    assert baseline.peak_bytes is not None and chosen.for_budget(20 * 8192).baselines[-1].name == "4 segments"
    assert model.__dict__.get("forward") is None  # the stack runs its own forward again


def test_a_segment_whose_first_blocks_build_no_graph_recomputes_them_too():
    """A checkpointed segment runs again from its first block, one that builds no graph included: the
    baseline's recompute counts what backward reruns, counted independently by the matrix products the
    recomputation dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gradaudit.planning import segments

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(9)])
    for block in model[:2]:
        block.requires_grad_(False)  # blocks 0 and 1 build no graph (the input needs no grad either)
    x = torch.randn(8, 64)
    chosen = plan(model, x, 10**9, measure_peak=False)
    baseline = next(b for b in chosen.baselines if b.name == "3 segments")
    assert [b["path"] for b in chosen.blocks] == [str(i) for i in range(2, 9)]
    # segments 0-2 and 3-5 are checkpointed: the first reruns blocks 0, 1 and 2, the second 3, 4 and 5;
    # a block's forward is its addmm (2 * 8 * 64 * 64) and its tanh (one per element written, 8 * 64)
    assert baseline.extra_flops == 6 * (2 * 8 * 64 * 64 + 8 * 64)

    class Products(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Products.count += func is torch.ops.aten.addmm.default  # (a forward Linear: backward's are mm)
            return func(*args, **(kwargs or {}))

    with segments.segmented(model, 3):
        loss = model(x).sum()
        with Products():
            loss.backward()
    assert Products.count == 6


def test_a_segment_may_not_begin_with_a_block_written_in_place_but_may_hold_one():
    """A block passed a tensor written in place cannot begin a checkpointed segment (the segment's
    checkpoint holds that tensor: backward would raise); inside one, its input is what the segment
    recomputes. Where no segment begins with one, the baseline is planned and its peak measured."""
    def stack(kinds):
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(32, 32) if kind == "L" else nn.ReLU(inplace=True) for kind in kinds])

    x = torch.randn(4, 32, requires_grad=True)
    inside = plan(stack("LRLLRLLRL"), x, 10**9)  # segments 0-2, 3-5, 6-8 begin with a Linear
    segmented = next(b for b in inside.baselines if b.name == "3 segments")
    assert segmented.peak_bytes > 0 and segmented.checkpointed == tuple(str(i) for i in range(6))
    assert not any("segments baseline" in note for note in inside.notes)
    starting = plan(stack("LRLRLRLRL"), x, 10**9, measure_peak=False)  # the second begins with ReLU 3
    assert not any(b.name.endswith("segments") for b in starting.baselines)
    assert any(note.startswith("no sqrt(n) segments baseline: its segment 2 would begin with 3, whose input is "
                               "written in place") for note in starting.notes)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sqrt_n_segments_of_a_stack_a_model_loop_runs(tiny_hf_model, family):
    from gradaudit.planning import segments

    model = tiny_hf_model(family, num_hidden_layers=9, use_cache=False).train()
    inputs = {"input_ids": torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))}
    chosen = plan(model, inputs, 10**9)
    baseline = next(b for b in chosen.baselines if b.name == "3 segments")  # sqrt(9): 3 segments of 3
    layers = [p for p in repeated_blocks(model)]
    assert baseline.checkpointed == tuple(layers[:6]) and baseline.peak_bytes is not None
    every = next(b for b in chosen.baselines if b.name == "every block")
    assert every.held_bytes < baseline.held_bytes < chosen.unplanned_held_bytes
    modules = [model.get_submodule(p) for p in layers]
    expected_grads, _ = step(model, inputs)
    with segments.loop_segmented(modules, 3):
        assert gradaudit.audit(model, inputs).saved_bytes == held_bytes_after_forward(model, inputs) \
            == baseline.held_bytes
        grads, _ = step(model, inputs)  # the same computation: gradients bit-identical
    assert grads.keys() == expected_grads.keys() and all(torch.equal(grads[k], expected_grads[k]) for k in grads)
    assert all("forward" not in m.__dict__ for m in modules)


@pytest.mark.parametrize("device, target", [("cpu", None), ("meta", "cpu"), ("meta", "cuda")])
def test_the_segments_step_is_measured_in_its_audits_run_to_the_same_figures(tiny_hf_model, monkeypatch, device,
                                                                            target):
    """The sqrt(n) segments baseline's step shares its audit's forward (auditing.audit_then_step): the plan
    runs one step fewer, and its JSON, every baseline's peak included, equals the plan's whose step ran
    apart (Step.forward_backward) - on the CPU and on meta standing for the CPU and for CUDA."""
    from gradaudit.fitting.step import Step
    from gradaudit.planning import planner

    model = tiny_hf_model("llama", num_hidden_layers=9, use_cache=False).train().to(device)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".5." in name)  # layers 0-4 build no graph; segment 3-5 reruns two of them
    inputs = {"input_ids": torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))}
    steps = []
    stepping = Step.forward_backward
    monkeypatch.setattr(Step, "forward_backward", lambda self, *a: steps.append(1) or stepping(self, *a))
    together = plan(model, inputs, 10**12, target=target)
    ran_together = len(steps)
    monkeypatch.setattr(planner, "_steps_with_audit", lambda model, inputs: False)
    steps.clear()
    apart = plan(model, inputs, 10**12, target=target)
    assert ran_together == len(steps) - 1 and any(b.name == "3 segments" for b in together.baselines)
    assert together.to_dict() == apart.to_dict()


def test_a_step_measured_in_an_audits_run_is_the_steps_own_and_leaves_the_callers_gradients():
    """audit_then_step's (held, peak) equal a step of their own on the CPU; its report equals audit's;
    gradients the caller had are put back untouched."""
    from gradaudit.auditing import audit_then_step
    from gradaudit.fitting.step import Step

    model, x = mlp_stack(4), torch.randn(32, 64, requires_grad=True)
    model(x).sum().backward()
    had = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    loss = lambda out: out.pow(2).sum()  # noqa: E731
    report, figures = audit_then_step(model, x, loss=loss)
    # held: each block's ReLU result (which its second Linear saves too) and Tanh output, the next block's
    # input: 2 * 4 - 1 storages of 32 x 64 float32 (the last Tanh's output is the output, not held)
    assert figures == Step(model, x, "cpu", loss_fn=loss).forward_backward() and figures[0] == 7 * 8192
    assert report.to_dict() == gradaudit.audit(model, x).to_dict()
    assert all(torch.equal(a, b) for a, b in zip(had, [p.grad for p in model.parameters()] + [x.grad]))


class PerLayerScales(nn.Module):
    """A loop passing each block a tensor of its own: no block can run its successors for it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.register_buffer("scales", torch.arange(1.0, 5.0).reshape(4, 1))

    def forward(self, x):
        for layer, scale in zip(self.layers, self.scales):
            x = torch.tanh(layer(x) * scale)
        return x


def test_no_segments_baseline_where_blocks_are_passed_tensors_of_their_own():
    from gradaudit.planning import segments

    model, x = PerLayerScales(), torch.randn(8, 16)
    chosen = plan(model, x, 10**9, measure_peak=False)
    assert [b.name for b in chosen.baselines] == ["none", "every block", "every 2 blocks"]
    assert any("no sqrt(n) segments baseline" in n for n in chosen.notes)
    with segments.loop_segmented(list(model.layers), 2), pytest.raises(GradauditError, match="other tensors"):
        model(x)  # forced anyway, the second block's own scale is caught, not silently replaced


def wide_stack(n: int = 12):
    """A stack whose activations outweigh its gradients (batch 512), so checkpointing lowers the peak."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32), nn.Tanh())
                            for _ in range(n)])
    return model, torch.randn(512, 32)


def test_a_budget_on_the_peak_chooses_the_cheapest_plan_whose_measured_peak_fits():
    from gradaudit.measure import forward_backward

    model, x = wide_stack()
    unplanned = plan(model, x, 10**12)
    budget = unplanned.unplanned_peak_bytes // 2
    chosen = plan(model, x, budget, bound="peak")
    assert chosen.bound == "peak" and chosen.fits and chosen.peak_bytes <= budget < chosen.unplanned_peak_bytes
    with chosen.apply(model):  # the peak it reports is one step's, as the tracker measures it again
        # (the loss a loop would take by default from a plain tensor output: its sum)
        assert forward_backward(model, (x,), {}, lambda out: out.sum())[1] == chosen.peak_bytes
    # the frontier point just cheaper than the chosen one peaks above the budget
    index = chosen.frontier.index((chosen.held_bytes, chosen.extra_flops))
    assert index > 0
    cheaper = plan(model, x, chosen.frontier[index - 1][0])
    assert cheaper.extra_flops < chosen.extra_flops and cheaper.peak_bytes > budget
    assert chosen.to_dict()["bound"] == "peak"


def test_a_sweep_never_raises_held_bytes_or_peak_as_the_budget_shrinks():
    model, x = wide_stack()
    first = plan(model, x, 10**12, bound="peak")
    top = first.unplanned_peak_bytes
    budgets = [int(top * f) for f in (0.3, 1.0, 0.8, 0.6, 0.45, 0.35)]  # in any order
    plans = first.sweep(budgets)
    assert [p.budget for p in plans] == budgets
    ordered = sorted(plans, key=lambda p: -p.budget)
    assert all(p.fits and p.peak_bytes <= p.budget for p in ordered)
    held = [p.held_bytes for p in ordered]
    peaks = [p.peak_bytes for p in ordered]
    assert held == sorted(held, reverse=True) and peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0]
    by_held = plan(model, x, 10**12, measure_peak=False)
    budgets = [int(first.unplanned_held_bytes * f) for f in (1.0, 0.9, 0.75, 0.6, 0.45, 0.3, 0.15)]
    held_sweep = by_held.sweep(budgets, measure_peak=True)
    assert all(p.fits for p in held_sweep)
    assert [p.held_bytes for p in held_sweep] == sorted((p.held_bytes for p in held_sweep), reverse=True)
    assert [p.peak_bytes for p in held_sweep] == sorted((p.peak_bytes for p in held_sweep), reverse=True)
    assert by_held.sweep(budgets)[0].peak_bytes is None  # unless asked, nothing runs


def test_a_peak_budget_nothing_fits_raises_with_the_least_peak():
    model, x = wide_stack(6)
    with pytest.raises(BudgetError) as caught:
        plan(model, x, 1, bound="peak")
    least = caught.value.smallest_plan
    assert caught.value.smallest == least.peak_bytes > 1 and not least.fits
    assert "no plan's peak fits 1 bytes" in str(caught.value)
    with pytest.raises(GradauditError, match="bound must be"):
        plan(model, x, 1, bound="both")
    with pytest.raises(GradauditError, match="measure_peak=False"):
        plan(model, x, 1, bound="peak", measure_peak=False)


def test_plan_with_a_frozen_stem_never_checkpoints_blocks_that_hold_nothing(vision_model):
    model = vision_model("resnet18").train()
    x = torch.randn(2, 3, 64, 64)
    trainable = ["layer3.*", "layer4.*", "fc.*"]
    planned = plan(model, x, 10**12, trainable=trainable, measure_peak=False)
    # no gradient flows through layer1 and layer2: they build no graph, hold nothing, and a
    # checkpoint of them would hold nothing and never recompute: they are not candidates
    assert [b["path"] for b in planned.blocks] == ["layer3.0", "layer3.1", "layer4.0", "layer4.1"]
    assert "4 block(s) build no autograd graph (layer1.0, layer1.1, layer2.0, ... (4 in all))" in planned.notes[0]
    every = next(b for b in planned.baselines if b.name == "every block")
    assert every.extra_flops == sum(b["flops"] for b in planned.blocks)
    assert_exact_and_identical(model, x, 0.5, trainable=trainable)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_plan_on_hugging_face_models_is_exact(tiny_hf_model, family):
    model = tiny_hf_model(family, num_hidden_layers=4, use_cache=False).train()
    inputs = {"input_ids": torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))}
    assert_exact_and_identical(model, inputs, 0.5)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_op_level_plans_are_exact_and_recompute_less(tiny_hf_model, family):
    # at 80% of the unplanned bytes, keeping each chosen block's matmul outputs and recomputing its
    # activations, norms and softmax frees enough: far less recompute than whole blocks
    model = tiny_hf_model(family, num_hidden_layers=4, use_cache=False).train()
    inputs = {"input_ids": torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))}
    budget = int(gradaudit.audit(model, inputs).saved_bytes * 0.8)
    chosen = plan(model, inputs, budget, measure_peak=False)
    whole = plan(model, inputs, budget, measure_peak=False, selective=False)
    assert chosen.selective and set(chosen.selective) <= set(chosen.checkpointed) and not whole.selective
    assert chosen.extra_flops < whole.extra_flops
    assert chosen.policies == {p: "selective" if p in chosen.selective else "full" for p in chosen.checkpointed}
    assert all(b["cached_bytes"] > 0 and 0 < b["kept_flops"] < b["flops"] for b in chosen.blocks)
    assert_exact_and_identical(model, inputs, 0.8)  # the same plan: re-audit, tracker, gradients


def test_an_in_place_change_of_a_kept_output_takes_the_op_level_option_away():
    # ReLU(inplace=True) overwrites the Linear's output, which an op-level checkpoint would keep:
    # backward would raise ("cached ... has been mutated"), so those blocks are checkpointed whole
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.ReLU(inplace=True), nn.Linear(256, 64))
                            for _ in range(4)])
    x = torch.randn(16, 64)
    unplanned = gradaudit.audit(model, x).saved_bytes
    planned = plan(model, x, unplanned // 2, measure_peak=False)
    assert all(b["cached_bytes"] is None for b in planned.blocks) and not planned.selective
    assert_exact_and_identical(model, x, 0.5)


def test_batch_norm_in_an_op_level_checkpoint_updates_its_statistics_once():
    # conv -> batch norm (train mode) -> GELU -> Tanh -> GELU blocks: op by op, the convolution's
    # and batch norm's outputs are kept and only the activations are recomputed (the Tanh result
    # is freed), so the running statistics are updated once
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.GELU(), nn.Tanh(),
                                          nn.GELU()) for _ in range(4)]).train()
    x = torch.randn(2, 8, 16, 16)
    unplanned = gradaudit.audit(model, x).saved_bytes
    chosen = plan(model, x, int(unplanned * 0.8), measure_peak=False)
    assert chosen.selective
    assert_exact_and_identical(model, x, 0.8)  # buffers (running mean, var, count) bit-identical


def test_ops_without_a_flop_formula_count_one_per_element_written():
    class Transposed(nn.Module):
        def forward(self, x):
            # two views (0), one copy of 8 x 64 elements (512) and a sine of as many (512)
            return torch.sin(x.t().contiguous().t())

    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), Transposed(), nn.Tanh())
    x = torch.randn(8, 64, requires_grad=True)
    chosen = plan(model, x, 10**9, blocks=["1", "2", "3"], measure_peak=False)
    # Tanh writes 8 x 64 = 512 elements; torch.utils.flop_counter alone would count 0
    assert [b["flops"] for b in chosen.blocks] == [512, 1024, 512]
    assert [b["kept_flops"] for b in chosen.blocks] == [0, 0, 0]


def test_plan_on_meta_equals_the_re_audit_on_meta(tiny_hf_config, transformers):
    with torch.device("meta"):
        model = transformers.BertModel(tiny_hf_config("bert", num_hidden_layers=6)).train()
    inputs = {"input_ids": torch.zeros(2, 16, dtype=torch.long, device="meta")}
    trainable = ["encoder.layer.2.*"]
    unplanned = gradaudit.audit(model, inputs, trainable=trainable)
    chosen = plan(model, inputs, unplanned.saved_bytes // 2, trainable=trainable)
    # layers 0-1 get no gradient and hold nothing: only layers 2-5 are worth recomputing
    assert chosen.checkpointed and all(int(p.split(".")[2]) >= 2 for p in chosen.checkpointed)
    with chosen.apply(model):
        assert gradaudit.audit(model, inputs, trainable=trainable).saved_bytes == chosen.held_bytes


def test_wrapped_numbers_stay_held_inside_checkpoints(tiny_hf_model):
    # GPT-2's GELU multiplies by Python floats: autograd saves those 0-dim tensors without
    # saved-tensor hooks, so a checkpointed block still holds them (3 x 8 B per block)
    model = tiny_hf_model("gpt2", num_hidden_layers=4, use_cache=False).train()
    inputs = {"input_ids": torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))}
    planned = assert_exact_and_identical(model, inputs, 0.3)
    checkpointed = plan(model, inputs, planned.saved_bytes, measure_peak=False).checkpointed
    kept = [t for t in planned.held_tensors if t.node == "MulBackward0" and t.shape == () and
            any(t.module.startswith(p + ".") for p in checkpointed)]
    assert kept and all(planned.storages[t.storage_id].nbytes == 8 for t in kept)


def test_peak_predicted_on_meta_equals_the_peak_measured_on_cpu(tiny_hf_config, transformers):
    # the same BERT on both devices: on meta the planned step runs on shapes alone, and the storage
    # tracker follows the tensors it would allocate; on CPU it runs for real
    def build(device):
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.BertModel(tiny_hf_config("bert", num_hidden_layers=6)).train()
        return model, {"input_ids": torch.zeros(2, 32, dtype=torch.long, device=device)}

    (cpu, cpu_inputs), (meta, meta_inputs) = build("cpu"), build("meta")
    budget = int(gradaudit.audit(cpu, cpu_inputs).saved_bytes * 0.6)
    on_cpu, on_meta = plan(cpu, cpu_inputs, budget), plan(meta, meta_inputs, budget)
    assert on_cpu.checkpointed == on_meta.checkpointed and on_cpu.held_bytes == on_meta.held_bytes
    assert abs(on_meta.peak_bytes - on_cpu.peak_bytes) <= 0.02 * on_cpu.peak_bytes  # equal here, in fact
    assert on_cpu.peak_bytes < on_cpu.unplanned_peak_bytes
    assert [b.peak_bytes for b in on_cpu.baselines] == [b.peak_bytes for b in on_meta.baselines]


def test_held_and_peak_never_rise_as_the_budget_shrinks(tiny_hf_model):
    model = tiny_hf_model("llama", num_hidden_layers=6, use_cache=False).train()
    inputs = {"input_ids": torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))}
    unplanned = gradaudit.audit(model, inputs).saved_bytes
    first = plan(model, inputs, unplanned)  # one audit; the other budgets off its frontier, each step measured
    plans = [first, *first.sweep([int(unplanned * f) for f in (0.8, 0.6, 0.4, 0.3)], measure_peak=True)]
    held, peaks = [p.held_bytes for p in plans], [p.peak_bytes for p in plans]
    assert held == sorted(held, reverse=True) and held[-1] < held[0]
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0]
    assert plans[0].peak_bytes == plans[0].unplanned_peak_bytes  # nothing checkpointed


# -- the solver -------------------------------------------------------------------------------------


def random_chain(rng: random.Random, n: int, selective: bool = False) -> Chain:
    """Blocks whose inputs are the previous block's output (sometimes saved inside it, sometimes
    not), plus storages shared by every block (a mask passed to all) and by two neighbours. With
    ``selective``, most blocks also have the op-level option: it keeps some of what they save
    inside (matmul outputs), sometimes their own output (the next block's input), sometimes a cache
    entry of its own, and recomputes part of their FLOPs."""
    nbytes, blocks, next_id = {}, [], 0

    def new(size: int) -> int:
        nonlocal next_id
        nbytes[next_id] = size
        next_id += 1
        return next_id - 1

    shared = new(rng.choice([0, 64, 4096]))
    outside = {new(rng.randint(1, 500))}
    previous_output = new(rng.randint(1, 2000))
    for i in range(n):
        internal = {new(rng.randint(1, 3000)) for _ in range(rng.randint(0, 3))}
        if rng.random() < 0.6:
            internal.add(previous_output)  # the block's first op saves its input
        output = new(rng.randint(1, 2000))
        if rng.random() < 0.5:
            internal.add(output)  # its last op saves its own result (the next block's input)
        inputs = {previous_output} | ({shared} if nbytes[shared] else set())
        flops = rng.randint(0, 5) * 100
        cached, kept = None, 0
        if selective and rng.random() < 0.8:
            cached = {s for s in internal if rng.random() < 0.5}
            if rng.random() < 0.3:
                cached.add(output)
            if rng.random() < 0.3:
                cached.add(new(rng.randint(1, 1000)))
            cached, kept = frozenset(cached), rng.randint(0, flops)
        blocks.append(Block(f"b{i}", "B", 1, flops, frozenset(internal), frozenset(inputs), cached, kept))
        previous_output = output
    return Chain(blocks, nbytes, frozenset(outside))


@pytest.mark.parametrize("selective", [False, True], ids=["whole-blocks", "with-op-level"])
@pytest.mark.parametrize("seed", range(40))
def test_solver_is_optimal_against_exhaustive_search(seed, selective):
    rng = random.Random(seed)
    chain = random_chain(rng, rng.randint(1, 7 if selective else 9), selective)
    points, exact = solve(chain)
    assert exact
    unplanned = chain.held(())
    least = min(p.held_bytes for p in points)
    assert exhaustive(chain, least - 1) is None  # nothing holds less than the frontier's last point
    for budget in sorted({unplanned, least, *(rng.randint(least, unplanned) for _ in range(6))}):
        best = cheapest_within(points, budget)
        truth = exhaustive(chain, budget)
        assert best is not None and truth is not None
        assert best.extra_flops == truth[0]
        assert best.held_bytes == chain.held(best.chosen, best.selective) <= budget
        assert best.extra_flops == chain.extra_flops(best.chosen, best.selective)
    assert cheapest_within(points, least - 1) is None


def test_a_selective_option_is_charged_as_inputs_plus_what_it_keeps():
    # block a: saves 1 (its input, 100 B) and 2 (a matmul output, 200 B) and 3 (a pointwise result,
    # 400 B); op by op it holds its input and the matmul output: 100 + 200 = 300 B, recomputing
    # 10 of its 50 FLOPs; checkpointed whole it holds 100 B for 50 FLOPs
    chain = Chain([Block("a", "B", 1, 50, frozenset({1, 2, 3}), frozenset({1}), frozenset({2}), 40)],
                  {1: 100, 2: 200, 3: 400}, frozenset())
    assert chain.held(()) == 700 and chain.held([0], [0]) == 300 and chain.held([0]) == 100
    points, exact = solve(chain)
    assert exact and [(p.held_bytes, p.extra_flops, sorted(p.selective)) for p in points] == [
        (700, 0, []), (300, 10, [0]), (100, 50, [])]
    assert cheapest_within(points, 500).selective == {0}
    with pytest.raises(ValueError):
        chain.held([], [0])  # op by op is a way of checkpointing: it must be checkpointed


def random_trimmed_chain(rng: random.Random, n: int, selective: bool = False) -> Chain:
    """random_chain's blocks under trim: some of their saves hold a bit-packed copy (1/32 of the
    storage, at least a byte) instead of the storage: of one of their own storages (also of their
    input or their result, which a neighbour holds whole: a ReLU result passed to the next block),
    of a storage of the copy's own, and outside the blocks of block 0's storages."""
    chain = random_chain(rng, n, selective)
    nbytes, bits, blocks = dict(chain.nbytes), {}, []

    def copy_of(storage: int) -> int:
        bits[len(bits)] = (storage, max(1, nbytes[storage] // 32))
        return len(bits) - 1

    for block in chain.blocks:
        internal, packed = set(block.internal), set()
        if internal and rng.random() < 0.6:
            storage = rng.choice(sorted(internal))
            internal.discard(storage)
            packed.add(copy_of(storage))
        if rng.random() < 0.3:
            nbytes[len(nbytes) + 1000] = rng.randint(1, 3000)
            packed.add(copy_of(len(nbytes) + 999))
        blocks.append(dataclasses.replace(block, internal=frozenset(internal), packed=frozenset(packed)))
    near = sorted(chain.blocks[0].internal | chain.blocks[0].inputs)
    outside = {copy_of(rng.choice(near))} if near and rng.random() < 0.5 else set()
    return Chain(blocks, nbytes, chain.outside, bits=bits, outside_packed=frozenset(outside))


@pytest.mark.parametrize("selective", [False, True], ids=["whole-blocks", "with-op-level"])
@pytest.mark.parametrize("seed", range(40))
def test_solver_is_optimal_with_bit_packed_copies(seed, selective):
    rng = random.Random(1000 + seed)
    chain = random_trimmed_chain(rng, rng.randint(1, 6 if selective else 8), selective)
    points, exact = solve(chain)  # (it raises where a charge differs from Chain.held)
    assert exact
    unplanned = chain.held(())
    least = min(p.held_bytes for p in points)
    assert exhaustive(chain, least - 1) is None
    for budget in sorted({unplanned, least, *(rng.randint(least, unplanned) for _ in range(6))}):
        best = cheapest_within(points, budget)
        truth = exhaustive(chain, budget)
        assert best is not None and truth is not None
        assert best.extra_flops == truth[0]
        assert best.held_bytes == chain.held(best.chosen, best.selective) <= budget
    assert cheapest_within(points, least - 1) is None


def test_a_copy_costs_nothing_while_its_storage_is_held_whole():
    # storage 1 (1000 B): block a bit-packs it (a 40 B copy), block b is passed it; storage 2 (100 B)
    # only as two copies of 60 B, which cost at most the storage
    chain = Chain([Block("a", "B", 1, 10, frozenset(), frozenset(), packed=frozenset({0, 1, 2})),
                   Block("b", "B", 1, 10, frozenset(), frozenset({1}), frozenset())],
                  {1: 1000, 2: 100}, frozenset(), bits={0: (1, 40), 1: (2, 60), 2: (2, 60)})
    assert chain.held(()) == 40 + 100
    assert chain.held([1]) == 1000 + 100  # b's checkpoint holds storage 1 whole: a's copy frees nothing
    assert chain.held([0]) == 0
    assert chain.held([0, 1]) == 1000
    points, exact = solve(chain)
    assert exact and [(p.held_bytes, p.extra_flops) for p in points] == [(140, 0), (0, 10)]


def test_frontier_is_monotone():
    rng = random.Random(7)
    chain = random_chain(rng, 12)
    points, _ = solve(chain)
    assert points[0].extra_flops == 0
    assert all(a.extra_flops < b.extra_flops and a.held_bytes > b.held_bytes for a, b in zip(points, points[1:]))
    # a sweep of budgets: held bytes never rise as the budget shrinks
    held = [cheapest_within(points, budget).held_bytes
            for budget in range(chain.held(()), points[-1].held_bytes - 1, -997)]
    assert held == sorted(held, reverse=True)


def test_storages_shared_by_distant_blocks_are_charged_as_held_and_said():
    # storage 9 is saved inside blocks 0 and 2 (not neighbours): the solver charges it as held
    chain = Chain([Block("a", "B", 1, 10, frozenset({1, 9}), frozenset()),
                   Block("b", "B", 1, 10, frozenset({2}), frozenset()),
                   Block("c", "B", 1, 10, frozenset({3, 9}), frozenset())],
                  {1: 100, 2: 100, 3: 100, 9: 1000}, frozenset())
    points, exact = solve(chain)
    assert not exact and chain.assumed == {9: 1000}
    assert points[-1].held_bytes == 0  # still exact: everything checkpointed holds nothing


# -- applying a plan --------------------------------------------------------------------------------


def test_apply_restores_the_model_and_refuses_a_second_plan():
    model, x = mlp_stack(), torch.randn(8, 64)
    chosen = plan(model, x, gradaudit.audit(model, x).saved_bytes // 2)
    forwards = {p: m.forward for p, m in model.named_modules()}
    handle = chosen.apply(model)
    assert handle.installed and all("forward" in dict(model.named_modules())[p].__dict__ for p in chosen.checkpointed)
    with pytest.raises(GradauditError, match="already applied"):
        chosen.apply(model)
    handle.remove()
    assert not handle.installed
    assert all(m.forward == forwards[p] and "forward" not in m.__dict__ for p, m in model.named_modules())
    with chosen.apply(model):
        with torch.no_grad():  # no graph, no checkpoint: plain forward
            model(x)
    with pytest.raises(GradauditError, match="no module named"):
        chosen.apply(nn.Linear(2, 2))


def test_keyword_and_nested_tensor_arguments_are_held_where_the_audit_sees_them():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, *, scale, pair):
            return torch.tanh(self.lin(x) * scale + pair[0] * pair[1])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(4)])

        def forward(self, x):
            scale = torch.sigmoid(x.mean(-1, keepdim=True))  # an activation passed by keyword
            pair = (x.exp(), x.cos())  # activations inside a tuple
            for block in self.blocks:
                x = block(x, scale=scale, pair=pair)
            return x

    torch.manual_seed(0)
    model, x = Model(), torch.randn(8, 16, requires_grad=True)
    assert_exact_and_identical(model, x, 0.6)


# -- refusals -----------------------------------------------------------------------------------------


def test_budget_below_what_any_plan_holds_raises_with_the_smallest():
    model, x = mlp_stack(), torch.randn(32, 64)
    with pytest.raises(BudgetError, match="no plan fits 100 bytes") as raised:
        plan(model, x, 100)
    # every block checkpointed: each holds only its input, t_0..t_4 (block 0's is the caller's x)
    assert raised.value.smallest == raised.value.smallest_plan.held_bytes == 5 * 8192
    assert len(raised.value.smallest_plan.checkpointed) == 6


def test_a_layer_applied_several_times_is_planned_as_one_block_of_all_its_calls(transformers):
    """Issue 45 item 6: ALBERT applies one layer N times, its weights shared; there are no repeated
    blocks, and plan used to refuse. The module called 6 times is the candidate (its checkpoint
    recomputes all 6 calls or none), said in a note; held exactly as the independent tracker measures,
    gradients bit-identical (dropout off: the tracker's forward and the step draw the same masks)."""
    config = transformers.AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=6,
                                       num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.AlbertForMaskedLM(config).train()
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    assert repeated_blocks(model) == []
    unplanned = gradaudit.audit(model, batch).saved_bytes
    chosen = plan(model, batch, unplanned // 2, measure_peak=False)
    group = "albert.encoder.albert_layer_groups.0"
    assert chosen.checkpointed == (group,) and [b["calls"] for b in chosen.blocks] == [6]
    assert any(f"{group} runs 6 times" in note and "all its calls or none" in note for note in chosen.notes)
    assert chosen.held_bytes < unplanned
    assert_step_held_and_identical(model, batch, chosen)


def test_progress_counts_the_peaks_it_measures():
    model, x = mlp_stack(), torch.randn(4, 64)
    told: list[str] = []
    plan(model, x, "1MiB", progress=told.append)
    peaks = [line for line in told if line.startswith("measuring the peak of a step")]
    assert peaks and all(re.match(rf"measuring the peak of a step, {i} of at most \d+ \(", line)
                         for i, line in enumerate(peaks, 1)), peaks


def test_bad_arguments_are_refused_with_what_to_do():
    model, x = mlp_stack(), torch.randn(4, 64)
    with pytest.raises(GradauditError, match="matches no module"):
        plan(model, x, "1MiB", blocks=["encoder.*"])
    with pytest.raises(GradauditError, match="malformed size"):
        plan(model, x, "lots")
    with pytest.raises(GradauditError, match="budget must be bytes"):
        plan(model, x, 1.5)
    with pytest.raises(GradauditError, match="no repeated blocks"):
        plan(nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True), 0)


def test_a_block_passed_a_cache_object_is_refused(tiny_hf_model):
    model = tiny_hf_model("llama", num_hidden_layers=2, use_cache=False).train()
    # the forward asked for a cache in so many words: a DynamicCache is passed to every block
    with pytest.raises(GradauditError, match="use_cache=False"):
        plan(model, {"input_ids": torch.zeros(1, 8, dtype=torch.long), "use_cache": True}, "1MiB")


def test_a_model_whose_config_keeps_use_cache_is_planned_as_hugging_face_checkpointing_trains_it(tiny_hf_model):
    model = tiny_hf_model("llama", num_hidden_layers=4).train()  # use_cache=True: the default config
    assert model.config.use_cache is True
    inputs = {"input_ids": torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))}
    unplanned = gradaudit.audit(model, inputs).saved_bytes
    chosen = plan(model, inputs, unplanned // 2, measure_peak=False)
    assert any("use_cache=True" in note for note in chosen.notes)
    assert model.config.use_cache is True  # left as found
    with chosen.apply(model):
        assert model.config.use_cache is False  # off while the plan is applied, as gradient_checkpointing_enable has it
        assert gradaudit.audit(model, inputs).saved_bytes == chosen.held_bytes <= unplanned // 2
    assert model.config.use_cache is True


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_that_already_checkpoints_is_reported_and_replanned(tiny_hf_model, reentrant):
    model = tiny_hf_model("llama", num_hidden_layers=4, use_cache=False).train()
    inputs = {"input_ids": torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))}
    unplanned = gradaudit.audit(model, inputs).saved_bytes
    hf_checkpointing(model, use_reentrant=reentrant)
    current = gradaudit.audit(model, inputs).saved_bytes
    chosen = plan(model, inputs, unplanned // 2, measure_peak=False)
    # planned from what the model holds without its own checkpointing, which it reports
    assert chosen.unplanned_held_bytes == unplanned and chosen.current_held_bytes == current < unplanned
    assert chosen.replaces == tuple(f"model.layers.{i}" for i in range(4))
    assert "itself and so holds" in chosen.notes[0]
    with pytest.raises(GradauditError, match=r"model\.activation_checkpointing_disable\(\)"):
        chosen.apply(model)
    # the model's checkpointing is untouched by planning
    assert gradaudit.audit(model, inputs).saved_bytes == current
    hf_checkpointing(model, on=False)
    with chosen.apply(model):
        assert gradaudit.audit(model, inputs).saved_bytes == chosen.held_bytes <= unplanned // 2


def test_checkpoint_calls_in_a_forward_are_turned_off_while_planning():
    from torch.utils.checkpoint import checkpoint

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = mlp_stack(4)

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x

    torch.manual_seed(0)
    model, x = Stack(), torch.randn(32, 64)
    chosen = plan(model, x, 10**9)
    # without its checkpoint calls the stack holds 8 * 8192 B (test_plan_of_a_sequential_stack_...
    # with 4 blocks); with them, the 3 block inputs that are activations: 3 * 8192
    assert chosen.unplanned_held_bytes == 8 * 8192 and chosen.current_held_bytes == 3 * 8192
    assert chosen.checkpointed == () and chosen.peak_bytes == chosen.unplanned_peak_bytes


def test_repeated_blocks_are_found_by_structure(vision_model, tiny_hf_model):
    assert repeated_blocks(vision_model("resnet18")) == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    assert repeated_blocks(tiny_hf_model("bert")) == ["encoder.layer.0", "encoder.layer.1"]
    assert repeated_blocks(mlp_stack(3)) == ["0", "1", "2"]


def test_plan_to_dict_is_plain_json():
    import json

    model, x = mlp_stack(), torch.randn(8, 64)
    data = json.loads(json.dumps(plan(model, x, "1MiB").to_dict()))
    assert data["kind"] == "plan" and data["fits"] and data["checkpointed"] == []
    assert data["schema_version"] == PLAN_SCHEMA_VERSION == 2
    assert [b["name"] for b in data["baselines"]][:2] == ["none", "every block"]
    assert data["frontier"][0] == {"held_bytes": data["unplanned_held_bytes"], "extra_flops": 0}
    # FLOPs are the default cost: no time was measured
    assert data["cost"] == "flops" and data["extra_seconds"] is None and data["step_seconds"] is None
    assert all(b["seconds"] is None for b in data["blocks"])


# -- the command line -------------------------------------------------------------------------------

STACK_FILE = '''
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh()) for _ in range(6)]
    return nn.Sequential(*blocks), torch.randn(32, 64)
'''


@pytest.fixture
def plan_cli(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from gradaudit.cli import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "stack.py").write_text(STACK_FILE)
    runner = CliRunner()
    return lambda *args: runner.invoke(cli, ["plan", "stack.py:build", *args], catch_exceptions=False)


def test_the_plan_beside_the_baselines_as_text(golden):
    from gradaudit.report import plantext

    # the stack of test_plan_of_a_sequential_stack_is_exact_and_minimal: 12 * 8192 B unplanned
    chosen = plan(mlp_stack(), torch.randn(32, 64), 9 * 8192)
    rows = {"this plan": chosen, **{b.name: b for b in chosen.baselines}}
    # every 3rd block (0, 3) frees 2 * 8192, too little; every 2nd (0, 2, 4) fits: 96 - 24 = 72 KiB
    assert rows.keys() == {"this plan", "none", "every block", "every 2 blocks", "2 segments"}
    # sqrt(6) ~ 2 segments of 3: blocks 0-2 checkpointed hold t_2; blocks 3-5 hold r and t: 7 * 8192 B
    assert rows["2 segments"].held_bytes == 7 * 8192 and len(rows["2 segments"].checkpointed) == 3
    assert rows["every 2 blocks"].held_bytes == 9 * 8192 <= chosen.budget  # fits
    assert chosen.held_bytes == 9 * 8192 and chosen.fits and len(chosen.checkpointed) == 2 and "5" in chosen.checkpointed
    assert rows["none"].held_bytes == 12 * 8192 > chosen.budget and rows["none"].extra_flops == 0  # +0.0%, no fit
    assert rows["every block"].held_bytes == 5 * 8192 and len(rows["every block"].checkpointed) == 6
    assert all(r.peak_bytes is not None for r in rows.values())
    # the table, as the CLI prints it (test_cli_prints_the_plan_beside_the_baselines)
    golden.assert_golden("plan.txt", plantext.render(chosen, repeats=timing.REPEATS) + "\n")
    unmeasured = plan(mlp_stack(), torch.randn(32, 64), 9 * 8192, measure_peak=False)
    assert all(r.peak_bytes is None for r in (unmeasured, *unmeasured.baselines))  # PEAK "-" in every row
    golden.assert_golden("plan-no-peak.txt", plantext.render(unmeasured, repeats=timing.REPEATS) + "\n")


def test_cli_prints_the_plan_beside_the_baselines(plan_cli, golden):
    # the plan of test_the_plan_beside_the_baselines_as_text: STACK_FILE is mlp_stack() and its input
    result = plan_cli("--budget", str(9 * 8192))
    assert result.exit_code == 0, result.output
    golden.assert_golden("plan.txt", result.output)
    unmeasured = plan_cli("--budget", str(9 * 8192), "--no-peak")
    golden.assert_golden("plan-no-peak.txt", unmeasured.output)


def test_cli_json_and_quiet(plan_cli, tmp_path):
    result = plan_cli("--budget", "1MiB", "--json", "plan.json", "-q")
    assert result.exit_code == 0, result.output
    assert result.output.count("\n") == 2  # the header and one summary line
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["held_bytes"] == data["unplanned_held_bytes"] == 12 * 8192 and data["checkpointed"] == []


def test_cli_exits_1_with_the_least_achievable_when_nothing_fits(plan_cli):
    result = plan_cli("--budget", "1KiB")
    assert result.exit_code == 1  # a negative verdict; 2 is for errors, click's usage errors among them
    assert "no plan fits: checkpointing the candidate blocks holds at least 40 KiB" in result.output


@pytest.mark.parametrize("args, message", [
    (["--budget", "lots"], "malformed size 'lots'"),
    (["--budget", "1MiB", "--blocks", "nothing.*"], "matches no module"),
    (["--budget", "1MiB", "--trainable", "nothing.*"], "nothing.*"),
])
def test_cli_errors_are_one_line_with_exit_2(plan_cli, args, message):
    result = plan_cli(*args)
    assert result.exit_code == 2
    assert result.stderr.startswith("gradaudit: error:") and message in result.stderr
    assert "Traceback" not in result.output


# -- models nobody here wrote -------------------------------------------------------------------------


def _autocast_stack():
    class UnderAutocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)])

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.blocks(x)

    torch.manual_seed(0)
    return UnderAutocast().train(), torch.randn(8, 64, requires_grad=True)


def _zoo(name, torchvision_or_transformers):
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    if name in ("vit",):
        torch.manual_seed(0)
        return torchvision_or_transformers.models.VisionTransformer(
            image_size=64, patch_size=16, num_layers=4, num_heads=2, hidden_dim=64, mlp_dim=128,
            num_classes=10).train(), torch.randn(2, 3, 64, 64)
    if name in ("convnext_tiny", "efficientnet_b0", "densenet121", "swin_t"):
        torch.manual_seed(0)
        return getattr(torchvision_or_transformers.models, name)(num_classes=10).train(), torch.randn(2, 3, 64, 64)
    tf = torchvision_or_transformers
    torch.manual_seed(0)
    if name == "bert-classifier":  # with an attention mask passed to every layer
        config = tf.BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                               vocab_size=100, max_position_embeddings=64)
        return tf.BertForSequenceClassification(config).train(), {"input_ids": ids,
                                                                   "attention_mask": torch.ones_like(ids)}
    if name == "t5":  # encoder and decoder stacks, cross-attention to the encoder's output
        config = tf.T5Config(d_model=32, d_ff=64, num_layers=3, num_heads=2, d_kv=16, vocab_size=100,
                             use_cache=False, decoder_start_token_id=0, pad_token_id=0)
        return tf.T5ForConditionalGeneration(config).train(), {"input_ids": ids, "labels": ids}
    if name == "mistral":
        config = tf.MistralConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=64, vocab_size=100, use_cache=False)
        return tf.MistralForCausalLM(config).train(), {"input_ids": ids}
    raise KeyError(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit", "convnext_tiny", "efficientnet_b0", "densenet121", "swin_t"])
def test_plan_on_torchvision_models(torchvision, name):
    # convnext and swin drop paths at random in train mode (stochastic depth): the recomputation
    # draws the same, so gradients stay bit-identical
    model, x = _zoo(name, torchvision)
    assert_exact_and_identical(model, x, 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-classifier", "t5", "mistral"])
def test_plan_on_more_hugging_face_models(transformers, name):
    model, inputs = _zoo(name, transformers)
    assert_exact_and_identical(model, inputs, 0.5)


def test_plan_under_autocast_inside_the_forward():
    model, x = _autocast_stack()
    assert_exact_and_identical(model, x, 0.5)


@pytest.mark.slow
def test_plan_on_a_peft_lora_model(tiny_hf_model):
    peft = pytest.importorskip("peft")
    model = tiny_hf_model("llama", num_hidden_layers=4, use_cache=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    inputs = {"input_ids": torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))}
    planned = assert_exact_and_identical(model.train(), inputs, 0.5)
    # the candidates are the decoder layers inside peft's wrappers
    assert any(t.node == "CheckpointInputs" and t.module.endswith(("layers.0", "layers.1", "layers.2", "layers.3"))
               for t in planned.held_tensors)


def test_html_plan_draws_the_frontier_and_escapes_module_names():
    from collections import OrderedDict

    from gradaudit.report import planhtml

    torch.manual_seed(0)
    names = ["a<b>", "c&d", "e'f", "g\"h"]  # nn.Sequential accepts any name without a dot
    model = nn.Sequential(OrderedDict((n, nn.Sequential(nn.Linear(32, 32), nn.Tanh())) for n in names))
    x = torch.randn(8, 32, requires_grad=True)
    # each block holds its Tanh result (8x32 float32 = 1024 B); checkpointed, it holds its input,
    # the previous block's result, unless that block is checkpointed too: 4096 B unplanned
    chosen = plan(model, x, 3 * 1024)
    page = planhtml.render(chosen)
    assert page.count('class="point"') == len(chosen.frontier)
    assert page.count('class="baseline"') == len(chosen.baselines)
    assert page.count('class="chosen"') == 1 and "Content-Security-Policy" in page and "<script" not in page
    assert "a&lt;b&gt;" in page and "a<b>" not in page and "c&amp;d" in page
    assert '<line class="budget"' in page and "held after the forward" in page
    # bounded by the peak, the budget is no line on the held-bytes axis, and the page says what it bounds
    by_peak = planhtml.render(plan(model, x, 10**9, bound="peak"))
    assert '<line class="budget"' not in by_peak and "for the peak of a step" in by_peak


def test_html_plan_says_where_it_stands_and_when_no_plan_fits():
    """The page says what the terminal says: "meta as cuda" on meta standing for a GPU, and where no plan
    fits, a headline saying so (not "Held under the plan" with a "no" in a table cell)."""
    from gradaudit.report import planhtml, plantext

    with torch.device("meta"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    x = torch.randn(8, 32, device="meta", requires_grad=True)
    fitting = plan(model, x, 3 * 1024, target="cuda", measure_peak=False)
    page = planhtml.render(fitting)
    assert "meta as cuda" in page and "meta as cuda" in plantext.render(fitting, repeats=1).splitlines()[0]
    assert "Held under the plan" in page and "No plan fits" not in page
    with pytest.raises(BudgetError) as raised:
        plan(model, x, 16, target="cuda", measure_peak=False)
    least = raised.value.smallest_plan
    assert not least.fits
    page = planhtml.render(least)
    assert "No plan fits the budget" in page and "Held under the plan" not in page
    assert "least possible" in page and "raise the budget" in page


def test_cli_writes_the_html_plan(plan_cli, tmp_path):
    result = plan_cli("--budget", "1MiB", "--html", "plan.html", "--no-peak")
    assert result.exit_code == 0 and "HTML plan: plan.html" in result.output
    assert "Memory against recompute" in (tmp_path / "plan.html").read_text()


def test_plan_for_a_cuda_target_on_meta(torchvision):
    # cuDNN batch norm (target="cuda") in the planned blocks, also in backward's recomputation
    # (which runs with the emulation's modes entered again): the re-audit equals the plan, and the
    # peak step runs (checkpoint compares what the recomputation saves with what the forward saved)
    with torch.device("meta"):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10).train()
    x = torch.randn(2, 3, 64, 64, device="meta")
    unplanned = gradaudit.audit(model, x, target="cuda")
    assert {n.name for n in unplanned.nodes if "BatchNorm" in n.name} == {"CudnnBatchNormBackward0"}
    chosen = plan(model, x, int(unplanned.saved_bytes * 0.7), target="cuda")
    assert chosen.target == "cuda" and chosen.to_dict()["target"] == "cuda"
    assert chosen.peak_bytes is not None and chosen.peak_bytes < chosen.unplanned_peak_bytes
    with chosen.apply(model):
        assert gradaudit.audit(model, x, target="cuda").saved_bytes == chosen.held_bytes


def test_for_budget_reads_other_budgets_off_the_same_frontier():
    model, x = mlp_stack(), torch.randn(32, 64)
    first = plan(model, x, "1MiB", measure_peak=False)
    for budget in (12 * 8192, 9 * 8192, 6 * 8192, 5 * 8192):
        again = first.for_budget(budget)
        fresh = plan(model, x, budget, measure_peak=False)
        assert (again.held_bytes, again.extra_flops, again.checkpointed) == \
            (fresh.held_bytes, fresh.extra_flops, fresh.checkpointed)
        assert again.budget == budget and again.peak_bytes is None
    with pytest.raises(BudgetError, match="no plan fits 100 bytes"):
        first.for_budget(100)


def test_cli_sweep_prints_one_line_per_budget(plan_cli, tmp_path):
    # 12, 9, 5 and 4 times 8192 bytes: the last is below what any plan holds (5 * 8192)
    result = plan_cli(*[a for b in (12, 9, 5, 4) for a in ("--budget", str(b * 8192))], "--json", "plans.json")
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0].endswith("4 budgets, unplanned 96 KiB held after the forward")
    assert [line.split()[:2] for line in lines[2:6]] == [["96", "KiB"], ["72", "KiB"], ["40", "KiB"], ["32", "KiB"]]
    assert "(nothing)" in lines[2] and "no plan fits" in lines[5]
    data = json.loads((tmp_path / "plans.json").read_text())
    assert [p["held_bytes"] for p in data["plans"]] == [12 * 8192, 9 * 8192, 5 * 8192, 5 * 8192]
    assert plan_cli("--budget", "1MiB", "--budget", "2MiB", "--html", "x.html").exit_code == 2


def test_cli_bound_peak_single_and_sweep(plan_cli, tmp_path):
    # the 6-block stack of STACK_FILE: a budget on the peak of a step, measured
    single = plan_cli("--budget", "10MiB", "--bound", "peak", "--json", "one.json")
    assert single.exit_code == 0, single.output
    assert "for the peak of a step" in single.output.splitlines()[0]
    data = json.loads((tmp_path / "one.json").read_text())
    assert data["bound"] == "peak" and data["fits"] and data["peak_bytes"] <= 10 * 2**20
    sweep = plan_cli("--budget", "10MiB", "--budget", "1", "--bound", "peak")
    assert sweep.exit_code == 1 and "PEAK" in sweep.output.splitlines()[1]
    assert "no plan fits" in sweep.output.splitlines()[3]
    refused = plan_cli("--budget", "10MiB", "--bound", "peak", "--no-peak")
    assert refused.exit_code == 2 and "--no-peak" in refused.output
    assert plan_cli("--budget", "10MiB", "--bound", "heap").exit_code == 2


def test_the_plan_json_is_what_its_schema_declares():
    """Every field of a plan's document is declared, with its description, in gradaudit.schemas (docs/json.md
    and docs/schemas/plan.schema.json are generated from it); tests/test_schemas.py covers the rest."""
    import jsonschema

    from gradaudit.schemas import json_schema

    model, x = mlp_stack(), torch.randn(8, 64)
    document = json.loads(json.dumps(plan(model, x, "1MiB", measure_peak=False).to_dict()))
    jsonschema.validate(document, json_schema("plan"))


def _random_stack(rng: random.Random) -> tuple[nn.Module, torch.Tensor]:
    width = rng.choice([8, 16])
    kinds = [
        lambda: nn.Sequential(nn.Linear(width, width), nn.ReLU()),
        lambda: nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.2)),
        lambda: nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.Tanh()),
        lambda: nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(), nn.Linear(2 * width, width)),
        lambda: nn.Sequential(nn.Linear(width, width, bias=False), nn.BatchNorm1d(width), nn.Sigmoid()),
    ]
    torch.manual_seed(rng.randrange(1000))
    model = nn.Sequential(*[rng.choice(kinds)() for _ in range(rng.randint(2, 6))])
    for p in model.parameters():
        p.requires_grad_(rng.random() < 0.6)
    model.train(rng.random() < 0.7)
    x = torch.randn(rng.choice([4, 8]), width, requires_grad=rng.random() < 0.5)
    return model, x


@pytest.mark.parametrize("seed", range(12))
def test_random_stacks_and_freezing_patterns(seed):
    rng = random.Random(seed)
    model, x = _random_stack(rng)
    if not x.requires_grad and not any(p.requires_grad for p in model.parameters()):
        next(model.parameters()).requires_grad_(True)
    unplanned = gradaudit.audit(model, x).saved_bytes
    first = plan(model, x, unplanned, measure_peak=False)
    least = first.frontier[-1][0]
    held = []
    for budget in sorted({unplanned, least, *(rng.randint(least, unplanned) for _ in range(3))}, reverse=True):
        chosen = first.for_budget(budget)
        assert chosen.held_bytes <= budget
        held.append(chosen.held_bytes)
        with chosen.apply(model):
            assert gradaudit.audit(model, x).saved_bytes == chosen.held_bytes
    assert held == sorted(held, reverse=True)  # never more as the budget shrinks
    # one step under the tightest plan: gradients and buffers bit-identical to the unplanned step
    tightest = first.for_budget(least)
    state = copy.deepcopy(model.state_dict())
    expected_grads, expected_buffers = step(model, x)
    model.load_state_dict(state)
    with tightest.apply(model):
        grads, buffers = step(model, x)
    model.load_state_dict(state)
    assert grads.keys() == expected_grads.keys() and all(torch.equal(grads[k], expected_grads[k]) for k in grads)
    assert all(torch.equal(buffers[k], expected_buffers[k]) for k in buffers)


# -- measured time as the cost ------------------------------------------------------------------------


class FakeClock:
    """A clock (nanoseconds) that moves only when a Tick runs: a block's measured time is exactly
    the ticks inside it, every run alike."""

    def __init__(self):
        self.now = 0

    def __call__(self):
        return self.now


class Tick(nn.Module):
    def __init__(self, clock: FakeClock, nanoseconds: int):
        super().__init__()
        self.clock, self.nanoseconds = clock, nanoseconds

    def forward(self, x):
        self.clock.now += self.nanoseconds
        return x


def test_time_cost_checkpoints_the_block_that_takes_least_time(monkeypatch, golden):
    from gradaudit.report import plantext

    clock = FakeClock()
    monkeypatch.setattr(timing, "clock", clock)
    model, x = mlp_stack(3, 64), torch.randn(32, 64)
    for block, nanoseconds in zip(model, (10**6, 10, 10**6)):
        block.append(Tick(clock, nanoseconds))
    # 6 * 8192 B unplanned (test_plan_of_a_sequential_stack_...): blocks 0 and 1 each free 8192 B
    # (their ReLU result), block 2 frees 2 * 8192 (its Tanh result too), all for the same FLOPs
    budget = 5 * 8192
    by_flops = plan(model, x, budget, measure_peak=False)
    assert by_flops.checkpointed == ("2",) and by_flops.held_bytes == 4 * 8192
    assert by_flops.cost == "flops" and by_flops.extra_seconds is None and by_flops.step_seconds is None
    # timed, block 1 takes 10 ns and the others 1 ms: block 1 is the cheapest that fits
    timed = plan(model, x, budget, measure_peak=False, cost="time")
    assert timed.cost == "time" and timed.checkpointed == ("1",) and timed.held_bytes == 5 * 8192
    assert timed.extra_seconds == 10e-9 and timed.step_seconds == (2 * 10**6 + 10) / 1e9
    assert timed.extra_compute == 10 / (2 * 10**6 + 10)
    assert [b["seconds"] for b in timed.blocks] == [1e-3, 1e-8, 1e-3]
    # the FLOP figures of the chosen plan are still there
    assert timed.extra_flops == timed.blocks[1]["flops"] == by_flops.extra_flops > 0
    assert timed.step_flops == by_flops.step_flops
    every = next(b for b in timed.baselines if b.name == "every block")
    assert every.extra_seconds == (2 * 10**6 + 10) / 1e9 and every.extra_flops == 3 * timed.extra_flops
    assert timed.share(every) == 1.0
    # the frontier is in seconds, and says so
    assert timed.frontier[0] == (6 * 8192, 0.0) and (5 * 8192, 10e-9) in timed.frontier
    data = json.loads(json.dumps(timed.to_dict()))
    assert data["cost"] == "time" and data["extra_seconds"] == 10e-9
    assert all(entry.keys() == {"held_bytes", "extra_seconds"} for entry in data["frontier"])
    assert data["baselines"][1]["extra_seconds"] == every.extra_seconds
    # another budget off the same frontier keeps the cost
    tighter = timed.for_budget(4 * 8192)
    assert tighter.cost == "time" and tighter.checkpointed == ("2",) and tighter.extra_seconds == 1e-3
    with timed.apply(model):
        assert gradaudit.audit(model, x).saved_bytes == timed.held_bytes
    # as text: milliseconds and their share of a step in every row (the CLI prints this table)
    golden.assert_golden("plan-time.txt", plantext.render(timed, repeats=timing.REPEATS) + "\n")


def test_time_cost_on_the_real_clock_plans_exactly():
    # timings are noisy: only the structure is checked, never a figure
    model, x = mlp_stack(), torch.randn(32, 64)
    assert_exact_and_identical(model, x, 0.6, cost="time")
    timed = plan(model, x, int(gradaudit.audit(model, x).saved_bytes * 0.6), cost="time", measure_peak=False)
    assert timed.extra_seconds > 0 and timed.step_seconds > 0 and timed.extra_flops > 0
    seconds = {b["path"]: b["seconds"] for b in timed.blocks}
    assert all(s > 0 for s in seconds.values())
    assert timed.extra_seconds == pytest.approx(sum(seconds[p] for p in timed.checkpointed))
    assert timed.extra_compute == timed.extra_seconds / timed.step_seconds
    assert all(a[1] < b[1] and a[0] > b[0] for a, b in zip(timed.frontier, timed.frontier[1:]))
    assert all(b.extra_seconds is not None for b in timed.baselines)
    # time is measured per block: a plan by time checkpoints whole blocks, and says why
    assert not timed.selective and any("op-level checkpointing left out" in n for n in timed.notes)


@pytest.mark.parametrize("cost", ["flops", "time"])
def test_planning_leaves_gradients_statistics_and_rng_as_found(cost):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Tanh())
                            for _ in range(4)]).train()
    x = torch.randn(8, 16, requires_grad=True)
    model(x).sum().backward()  # gradients the caller has: planning must not add to them
    grads = {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()}
    input_grad = (x.grad, x.grad.clone())
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    plan(model, x, int(gradaudit.audit(model, x).saved_bytes * 0.6), cost=cost)
    assert all(p.grad is grads[n][0] and torch.equal(p.grad, grads[n][1]) for n, p in model.named_parameters())
    assert x.grad is input_grad[0] and torch.equal(x.grad, input_grad[1])
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_time_cost_is_refused_on_meta_and_an_unknown_cost_is_refused():
    with torch.device("meta"):
        model = mlp_stack()
    with pytest.raises(GradauditError, match="meta device computes nothing") as raised:
        plan(model, torch.randn(32, 64, device="meta"), "1MiB", cost="time")
    assert "\n" not in str(raised.value) and "cost='flops'" in str(raised.value)
    with pytest.raises(GradauditError, match="cost must be one of 'flops', 'time', not 'speed'"):
        plan(mlp_stack(), torch.randn(4, 64), "1MiB", cost="speed")


def test_cli_plans_by_measured_time(plan_cli, tmp_path):
    result = plan_cli("--budget", str(9 * 8192), "--cost", "time", "--json", "plan.json")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[2].split() == ["HELD", "PEAK", "EXTRA", "TIME", "BLOCKS", "FITS"]
    data = json.loads((tmp_path / "plan.json").read_text())
    rows = {"this plan": data, **{b["name"]: b for b in data["baselines"]}}
    assert rows.keys() == {"this plan", "none", "every block", "every 2 blocks", "2 segments"}
    # sqrt(6) ~ 2 segments of 3: blocks 0-2 checkpointed hold t_2; blocks 3-5 hold r and t: 7 * 8192 B
    assert rows["2 segments"]["held_bytes"] == 7 * 8192 and len(rows["2 segments"]["checkpointed"]) == 3
    assert rows["none"]["extra_seconds"] == 0 and rows["every block"]["extra_seconds"] > 0
    # each of the five rows prints its milliseconds and their share of a step (the layout: tests/golden/plan-time.txt)
    assert [" ms (+" in line for line in lines[3:9]] == [True] * 5 + [False]
    assert any(line.startswith("extra time: ") for line in lines)
    assert data["cost"] == "time" and data["extra_seconds"] > 0 and data["step_seconds"] > 0
    assert data["held_bytes"] <= 9 * 8192 and data["frontier"][0] == {"held_bytes": 12 * 8192, "extra_seconds": 0}
    quiet = plan_cli("--budget", str(9 * 8192), "--cost", "time", "-q", "--no-peak")
    assert quiet.exit_code == 0 and re.search(r"extra time \+[\d.]+ ms \(\+[\d.]+%\)", quiet.output)
    sweep = plan_cli("--budget", str(12 * 8192), "--budget", str(9 * 8192), "--cost", "time")
    assert sweep.exit_code == 0 and "EXTRA TIME" in sweep.output and " ms (+" in sweep.output


def test_cli_refuses_time_on_meta_and_unknown_costs(plan_cli):
    meta = plan_cli("--budget", "1MiB", "--cost", "time", "--device", "meta")
    assert meta.exit_code == 2 and meta.stderr.count("\n") == 1
    assert meta.stderr.startswith("gradaudit: error: --cost time") and "--cost flops" in meta.stderr
    unknown = plan_cli("--budget", "1MiB", "--cost", "speed")
    assert unknown.exit_code == 2 and "Invalid value for '--cost'" in unknown.stderr


# -- a storage saved both inside a block and after it ---------------------------------------------


def test_a_block_result_saved_outside_the_blocks_stays_held_when_checkpointed():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU())
                                          for _ in range(3)])
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.blocks(x))

    torch.manual_seed(0)
    model, x = Head(), torch.randn(8, 16)
    # block i holds its Tanh result t_i and ReLU result r_i (8x16 float32: 512 B each; its input
    # r_{i-1} is block i-1's result, x is the caller's): 6 * 512 B. Checkpointed, block i holds
    # its input r_{i-1} instead, and r_2 stays held by the head's addmm (which saves its input)
    # although ReluBackward in block 2 saved it too: 3 * 512 B at least
    assert gradaudit.audit(model, x).saved_bytes == 6 * 512
    with pytest.raises(BudgetError) as raised:
        plan(model, x, 0, measure_peak=False)
    assert raised.value.smallest == 3 * 512 and len(raised.value.smallest_plan.checkpointed) == 3
    assert_exact_and_identical(model, x, 0.5)


# -- planning on top of trim ----------------------------------------------------------------------


class ConvStack(nn.Module):
    """Frozen conv, batch norm, ReLU and a size-keeping max pool per block, and a frozen head: in
    eval mode with the input requiring grad, trim drops or bit-packs most of what each block saves."""

    def __init__(self, n: int = 4, channels: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                          nn.ReLU(), nn.MaxPool2d(3, stride=1, padding=1)) for _ in range(n))
        self.head = nn.Linear(channels * 64, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1))




def conv_stack():
    torch.manual_seed(0)
    model = ConvStack().eval()
    model.requires_grad_(False)
    for norm in model.modules():
        if isinstance(norm, nn.BatchNorm2d):
            norm.running_var.uniform_(0.5, 2.0)
    return model, torch.randn(2, 4, 8, 8, requires_grad=True)


def assert_trimmed_plan_exact_and_identical(model: nn.Module, inputs, fraction: float, trainable=None) -> gradaudit.Plan:
    """Plan on top of trim to ``fraction`` of what the trimmed model holds unplanned. With the plan
    applied (which installs trim, and removes it again), the re-audit's trimmed figure (saved_bytes
    - reclaimable_with_bitpacking_bytes, which its note states) and the independent storage tracker
    both hold exactly plan.held_bytes; one step gives gradients and buffers bit-identical to the
    plain step: no trim, no plan."""
    from gradaudit.trimming import is_trimmed

    audited = gradaudit.audit(model, inputs, trainable=trainable)
    trimmed = audited.saved_bytes - audited.reclaimable_with_bitpacking_bytes
    budget = int(trimmed * fraction)
    chosen = plan(model, inputs, budget, trainable=trainable, trim=True, measure_peak=False)
    assert chosen.trimmed and chosen.bitpack and chosen.to_dict()["trim"] == {"bitpack": True, "masks": "bits"}
    assert chosen.unplanned_held_bytes == trimmed < audited.saved_bytes
    assert chosen.held_bytes <= budget < trimmed and chosen.checkpointed
    with chosen.apply(model):
        assert is_trimmed(model)
        planned = gradaudit.audit(model, inputs, trainable=trainable)
    assert not is_trimmed(model)
    held = planned.saved_bytes - planned.reclaimable_with_bitpacking_bytes
    assert held == chosen.held_bytes and any(f"= {held} bytes" in note for note in planned.notes)
    if trainable is None:
        assert_step_held_and_identical(model, inputs, chosen)
    return chosen


class FusedDropoutBlock(nn.Module):
    """A frozen linear layer, CUDA's fused dropout (native_dropout: a bool keep-mask, GA403) and a
    trainable linear layer."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.frozen = nn.Linear(width, width).requires_grad_(False)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        return self.out(torch.native_dropout(self.frozen(x), 0.3, self.training)[0])


class FusedDropoutStack(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(FusedDropoutBlock() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_plan_on_top_of_trim_counts_bool_dropout_masks_as_bits():
    # per block (8 x 32 activations): the trainable layer's float32 input, 1024 B, and the bool mask,
    # 256 B, which trim keeps as 32 B of bits (block 0's dropout makes no node: nothing before it
    # needs a gradient): the plan, the re-audit and the storage tracker agree
    torch.manual_seed(0)
    model, x = FusedDropoutStack().train(), torch.randn(8, 32)
    audited = gradaudit.audit(model, x)
    assert audited.reclaimable_with_bitpacking_bytes == 3 * (256 - 32)
    assert_trimmed_plan_exact_and_identical(model, x, 0.8)


def test_plan_on_top_of_trim_counts_what_trim_leaves():
    model, x = conv_stack()
    # per block (2x4x8x8 float32 activations, 2048 B; int64 pool indices, 4096 B): the conv saves its
    # input a_{i-1} (block 0's is the caller's x), eval batch norm its input c_i, ReLU its result r_i
    # (also the pool's input), the pool its indices: 2048 * 3 + 4096 = 10240 B, block 0 8192 B
    untrimmed = plan(model, x, 10**9, trim=False, measure_peak=False)
    assert untrimmed.unplanned_held_bytes == 8192 + 3 * 10240
    # trim drops a_{i-1} and c_i (frozen conv weight, eval batch norm with frozen affine), keeps one
    # bit per element of r_i (the pool's save of it is dropped: 512 elements / 8 = 64 B) and the
    # indices: 64 + 4096 = 4160 B per block
    # (whole blocks only: op by op, a block would keep its convolution's and batch norm's outputs whole)
    chosen = plan(model, x, 3 * 4160, trim=True, measure_peak=False, selective=False)
    assert chosen.unplanned_held_bytes == 4 * 4160
    # checkpointed, block i holds its input a_{i-1} whole (2048 B) instead: 4160 - 2048 = 2112 B less,
    # and block 0 (passed the caller's x) 4160 B less, for the same recompute: block 0 it is
    assert chosen.checkpointed == ("blocks.0",) and chosen.held_bytes == 3 * 4160
    flops = chosen.blocks[0]["flops"]
    assert flops > 0 and all(b["flops"] == flops for b in chosen.blocks)
    assert chosen.frontier == ((16640, 0), (16640 - 4160, flops), (16640 - 4160 - 2112, 2 * flops),
                               (16640 - 4160 - 2 * 2112, 3 * flops), (16640 - 4160 - 3 * 2112, 4 * flops))
    assert [b["internal_bytes"] for b in chosen.blocks] == [4160] * 4
    assert [b["input_bytes"] for b in chosen.blocks] == [0, 2048, 2048, 2048]
    # 2 segments: blocks 0-1 in one checkpoint (passed the caller's x: free), blocks 2-3 trimmed as
    # usual (their input's save dropped): 2 * 4160
    assert {b.name: b.held_bytes for b in chosen.baselines} == {"none": 16640, "every block": 3 * 2048,
                                                                "every 2 blocks": 16640 - 4160 - 2112,
                                                                "2 segments": 2 * 4160}
    # without trim the same budget takes every block (the untrimmed frontier falls by 8192 B a block)
    assert len(plan(model, x, 10**9, trim=False, measure_peak=False, selective=False).for_budget(
        3 * 4160).checkpointed) == 4
    assert_trimmed_plan_exact_and_identical(model, x, 0.75)


def test_plan_on_top_of_trim_without_bitpacking():
    model, x = conv_stack()
    # bitpack=False: r_i is kept whole (2048 B instead of 64): 2048 + 4096 = 6144 B per block
    chosen = plan(model, x, 10**9, trim=True, bitpack=False, measure_peak=False)
    assert chosen.unplanned_held_bytes == 4 * 6144 and chosen.to_dict()["trim"] == {"bitpack": False, "masks": "bits"}
    least = chosen.for_budget(chosen.frontier[-1][0])
    assert least.held_bytes == 3 * 2048  # every block: the inputs a_0..a_2
    with least.apply(model) as handle:
        assert handle.trim_handle is not None and handle.trim_handle.bitpack is False
        assert held_bytes_after_forward(model, x) == least.held_bytes
        report = gradaudit.audit(model, x)
    assert report.saved_bytes - report.reclaimable_bytes == least.held_bytes


@pytest.mark.parametrize("scenario", ["norm-only", "input-only"])
def test_plan_on_top_of_trim_on_resnet(vision_model, scenario):
    from gradaudit.scenarios import apply_scenario

    model, x = vision_model("resnet18"), torch.randn(2, 3, 64, 64)
    apply_scenario(model, scenario, x)
    assert_trimmed_plan_exact_and_identical(model, x, 0.8)


def test_plan_on_top_of_trim_on_resnet_with_a_trainable_tail(vision_model):
    model = vision_model("resnet18").train()
    x = torch.randn(2, 3, 64, 64)
    trainable = ["layer4.*", "fc.*"]
    assert_trimmed_plan_exact_and_identical(model, x, 0.5, trainable=trainable)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_plan_on_top_of_trim_on_hugging_face_models(tiny_hf_model, family):
    # train mode: trim bit-packs the dropout masks (and BERT's ReLU results) outside the checkpointed
    # layers; inside them the recomputation draws the same masks again
    overrides = {"hidden_act": "relu"} if family == "bert" else {"use_cache": False}
    model = tiny_hf_model(family, num_hidden_layers=4, **overrides).train()
    inputs = {"input_ids": torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))}
    assert_trimmed_plan_exact_and_identical(model, inputs, 0.5)


def test_plan_on_top_of_trim_with_nothing_to_trim_equals_the_plain_plan(tiny_hf_model):
    model = tiny_hf_model("llama", num_hidden_layers=4, use_cache=False).train()
    inputs = {"input_ids": torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))}
    assert gradaudit.audit(model, inputs).reclaimable_with_bitpacking_bytes == 0  # trim keeps every save
    budget = int(plan(model, inputs, 10**9, measure_peak=False).unplanned_held_bytes * 0.5)
    plain = plan(model, inputs, budget)
    trimmed = plan(model, inputs, budget, trim=True)
    figures = ("held_bytes", "unplanned_held_bytes", "extra_flops", "checkpointed", "frontier", "blocks",
               "peak_bytes", "unplanned_peak_bytes")
    assert [getattr(trimmed, f) for f in figures] == [getattr(plain, f) for f in figures]
    assert [b.to_dict() for b in trimmed.baselines] == [b.to_dict() for b in plain.baselines]
    assert trimmed.trimmed and not plain.trimmed and plain.to_dict()["trim"] is None
    with trimmed.apply(model):
        assert gradaudit.audit(model, inputs).saved_bytes == trimmed.held_bytes
    assert_step_held_and_identical(model, inputs, trimmed)  # the tracker too, and the gradients


def test_plan_on_top_of_trim_on_meta_equals_cpu(torchvision):
    from gradaudit.scenarios import apply_scenario

    def build(device):
        torch.manual_seed(0)
        with torch.device(device):
            model = torchvision.models.resnet18(num_classes=10)
        x = torch.randn(2, 3, 64, 64, device=device)
        apply_scenario(model, "norm-only", x)
        return model, x

    (cpu, cpu_x), (meta, meta_x) = build("cpu"), build("meta")
    on_cpu = plan(cpu, cpu_x, 1_600_000, trim=True, measure_peak=False)
    on_meta = plan(meta, meta_x, 1_600_000, trim=True)
    figures = ("held_bytes", "unplanned_held_bytes", "checkpointed", "frontier", "blocks")
    assert [getattr(on_meta, f) for f in figures] == [getattr(on_cpu, f) for f in figures]
    assert [b.held_bytes for b in on_meta.baselines] == [b.held_bytes for b in on_cpu.baselines]
    assert on_meta.peak_bytes is not None  # the planned step ran on meta, trim included
    with on_meta.apply(meta):
        report = gradaudit.audit(meta, meta_x)
        assert held_bytes_after_forward(meta, meta_x) == on_meta.held_bytes
    assert report.saved_bytes - report.reclaimable_with_bitpacking_bytes == on_meta.held_bytes


def test_a_plan_on_top_of_trim_measures_the_steady_step_a_training_loop_runs(vision_model):
    """trim decides in a model's first forward and follows that plan in the next ones; a plan's peak is
    the later steps', measured independently (measure.forward_backward, after a first trimmed step).
    ResNet-50, input only: a steady forward bit-packs a ReLU's result at the end of the ReLU's call,
    where the first forward waited for the next boundary (18,432 bytes more at the peak here): a plan
    measuring only a first forward said 8,188,928."""
    from gradaudit.measure import forward_backward
    from gradaudit.scenarios import apply_scenario
    from gradaudit.trimming import trim

    model, x = vision_model("resnet50"), torch.randn(2, 3, 64, 64)
    apply_scenario(model, "input-only", x)
    chosen = plan(model, x, 10**12, trim=True)
    with trim(model) as handle:
        forward_backward(model, (x,), {})
        x.grad = None
        held, peak = forward_backward(model, (x,), {})
        assert handle.forwards == {"full": 1, "steady": 1}
    x.grad = None
    assert (held, peak) == (chosen.held_bytes, chosen.peak_bytes) == (7_928_832, 8_207_360)


def test_a_plan_on_top_of_trim_with_byte_masks_measures_the_steady_step(vision_model):
    """plan(trim=True, masks="bytes") counts what trim(masks="bytes") keeps: a bool per element of each
    bit-packable save where bits keep one bit. ResNet-50, input only: its held and peak equal a steady
    step's with that trim installed, measured independently, and hold more than the bits' plan (the
    49 ReLU results it packs keep 7/8 of a byte more per element)."""
    from gradaudit.measure import forward_backward
    from gradaudit.scenarios import apply_scenario
    from gradaudit.trimming import trim

    model, x = vision_model("resnet50"), torch.randn(2, 3, 64, 64)
    apply_scenario(model, "input-only", x)
    chosen = plan(model, x, 10**12, trim=True, masks="bytes")
    assert chosen.masks == "bytes" and chosen.to_dict()["trim"] == {"bitpack": True, "masks": "bytes"}
    with trim(model, masks="bytes") as handle:
        forward_backward(model, (x,), {})
        x.grad = None
        held, peak = forward_backward(model, (x,), {})
        assert handle.forwards == {"full": 1, "steady": 1}
    x.grad = None
    assert (held, peak) == (chosen.held_bytes, chosen.peak_bytes)
    assert chosen.held_bytes > 7_928_832  # the bits' plan (the test above)


def test_plan_on_top_of_trim_with_byte_masks_counts_a_bool_per_element():
    model, x = conv_stack()
    # as with bits (test_plan_on_top_of_trim_counts_what_trim_leaves), but r_i (512 float32 elements)
    # is kept as 512 bools: 512 + 4096 B of pool indices = 4608 B per block
    chosen = plan(model, x, 3 * 4608, trim=True, masks="bytes", measure_peak=False, selective=False)
    assert chosen.unplanned_held_bytes == 4 * 4608
    # checkpointed, block i holds its input a_{i-1} whole (2048 B): 2560 B less; block 0 (passed the
    # caller's x) 4608 B less, for the same recompute: block 0 it is
    assert chosen.checkpointed == ("blocks.0",) and chosen.held_bytes == 3 * 4608
    assert [b["internal_bytes"] for b in chosen.blocks] == [4608] * 4
    assert_step_held_and_identical(model, x, chosen)
    # CUDA's fused dropout keeps a bool keep-mask, which bytes leave as it is: 256 B per block after
    # the first, where bits keep 32 (test_plan_on_top_of_trim_counts_bool_dropout_masks_as_bits)
    torch.manual_seed(0)
    model, x = FusedDropoutStack().train(), torch.randn(8, 32)
    as_bytes = plan(model, x, 10**9, trim=True, masks="bytes", measure_peak=False)
    untrimmed = plan(model, x, 10**9, trim=False, measure_peak=False)
    as_bits = plan(model, x, 10**9, trim=True, measure_peak=False)
    assert as_bytes.unplanned_held_bytes == untrimmed.unplanned_held_bytes == as_bits.unplanned_held_bytes + 3 * 224
    assert_step_held_and_identical(model, x, plan(model, x, int(as_bytes.unplanned_held_bytes * 0.8), trim=True,
                                                  masks="bytes", measure_peak=False))


def test_a_plan_follows_an_installed_trims_masks_and_refuses_others():
    from gradaudit.trimming import trim

    model, x = conv_stack()
    expected = plan(model, x, 3 * 4608, trim=True, masks="bytes", measure_peak=False, selective=False)
    with trim(model, masks="bytes"):
        found = plan(model, x, 3 * 4608, measure_peak=False, selective=False)
        # the same bytes (the FLOPs differ: an installed trim's own operations count in its step's)
        assert found.masks == "bytes" and found.trimmed
        assert (found.unplanned_held_bytes, found.held_bytes, found.checkpointed) == \
            (expected.unplanned_held_bytes, expected.held_bytes, expected.checkpointed) == (4 * 4608, 3 * 4608, ("blocks.0",))
        with pytest.raises(GradauditError, match="installed on this model with masks='bytes': plan with masks='bytes'"):
            plan(model, x, 3 * 4608, trim=True, masks="bits", measure_peak=False)
    with pytest.raises(GradauditError, match="masks='bytes' is an option of trim"):
        plan(model, x, 10**9, masks="bytes")
    with pytest.raises(GradauditError, match="masks='bit': choose one of 'auto', 'bits', 'bytes'"):
        plan(model, x, 10**9, trim=True, masks="bit")
    with trim(model):  # bits installed: a plan with byte masks cannot apply over it
        with pytest.raises(GradauditError, match="with masks='bits': plan with masks='bits'"):
            plan(model, x, 10**9, trim=True, masks="bytes", measure_peak=False)


def test_a_model_that_checkpoints_itself_reports_what_it_holds_with_trim():
    from torch.utils.checkpoint import checkpoint

    from gradaudit.trimming import trim

    class Checkpointing(ConvStack):
        def forward(self, x):
            for i, block in enumerate(self.blocks):
                x = checkpoint(block, x, use_reentrant=False) if i in (1, 2) else block(x)
            return self.head(x.flatten(1))

    torch.manual_seed(0)
    model = Checkpointing().eval()
    model.requires_grad_(False)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    chosen = plan(model, x, 10**9, trim=True, measure_peak=False)
    # trimmed, blocks 0 and 3 hold 4160 B each (test_plan_on_top_of_trim_counts_what_trim_leaves);
    # the checkpointed blocks 1 and 2 hold their inputs a_0 and a_1 whole, 2048 B each
    assert chosen.replaces == ("blocks.1", "blocks.2") and chosen.unplanned_held_bytes == 4 * 4160
    assert chosen.current_held_bytes == 2 * 4160 + 2 * 2048
    with trim(model):
        assert held_bytes_after_forward(model, x) == chosen.current_held_bytes


def test_a_trimmed_model_is_planned_with_its_trim():
    from gradaudit.trimming import is_trimmed, trim

    model, x = conv_stack()
    with trim(model) as own:
        chosen = plan(model, x, 3 * 4160, measure_peak=False)  # trim=None follows the model
        assert chosen.trimmed and chosen.held_bytes == 3 * 4160  # as in test_plan_on_top_of_trim_...
        assert any("gradaudit.trim is installed on this model (bitpack=True, masks='bits')" in note
                   for note in chosen.notes)
        with chosen.apply(model) as handle:
            assert handle.trim_handle is None  # the caller's trim serves
            assert held_bytes_after_forward(model, x) == chosen.held_bytes
        assert is_trimmed(model) and own.installed  # and stays theirs
        with pytest.raises(GradauditError, match="plan with trim=True"):
            plan(model, x, "1MiB", trim=False)
        with pytest.raises(GradauditError, match="installed on this model with bitpack=True"):
            plan(model, x, "1MiB", bitpack=False)
    plain = plan(model, x, 10**9, measure_peak=False)
    assert not plain.trimmed and plain.unplanned_held_bytes == 8192 + 3 * 10240
    with trim(model):
        with pytest.raises(GradauditError, match="figures are without gradaudit.trim"):
            plain.apply(model)
    with trim(model, bitpack=False):
        with pytest.raises(GradauditError, match="remove that handle first"):
            chosen.apply(model)
    with pytest.raises(GradauditError, match="option of trim: pass trim=True"):
        plan(model, x, "1MiB", bitpack=False)
    with pytest.raises(GradauditError, match="trim must be True, False or None"):
        plan(model, x, "1MiB", trim="yes")


CONV_STACK_FILE = '''
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                            nn.MaxPool2d(3, stride=1, padding=1)) for _ in range(4)]
    model = nn.Sequential(*blocks, nn.Flatten(), nn.Linear(256, 10)).eval()
    model.requires_grad_(False)
    return model, torch.randn(2, 4, 8, 8, requires_grad=True)
'''


def test_cli_plans_on_top_of_trim(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from gradaudit.cli import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "convs.py").write_text(CONV_STACK_FILE)
    runner = CliRunner()

    def run(*args):
        return runner.invoke(cli, ["plan", "convs.py:build", "--blocks", "[0-3]", *args], catch_exceptions=False)

    # the blocks of test_plan_on_top_of_trim_counts_what_trim_leaves: 4 * 4160 B trimmed, 3 * 4160 B
    # with block 0 checkpointed
    result = run("--budget", str(3 * 4160), "--trim", "--json", "plan.json")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].endswith("held after the forward with gradaudit.trim")
    assert lines[1] == "checkpoint 1 of 4 blocks: 0"
    assert any(line.startswith("held: after the forward with gradaudit.trim installed") for line in lines)
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["trim"] == {"bitpack": True, "masks": "bits"}
    assert (data["held_bytes"], data["unplanned_held_bytes"]) == (3 * 4160, 4 * 4160)
    # without bit-packing the ReLU results stay whole: 4 * (2048 + 4096) B unplanned
    result = run("--budget", str(10**6), "--trim", "--no-bitpack", "--json", "plan.json", "--no-peak")
    assert result.exit_code == 0
    assert result.output.splitlines()[0].endswith("held after the forward with gradaudit.trim (no bit-packing)")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["trim"] == {"bitpack": False, "masks": "bits"} and data["unplanned_held_bytes"] == 4 * 6144
    # untrimmed, the same budget takes all four blocks; and --no-bitpack alone is refused
    data = json.loads(run("--budget", str(3 * 4160), "--json", "-", "-q").stdout)
    assert data["trim"] is None and len(data["checkpointed"]) == 4
    refused = run("--budget", "1MiB", "--no-bitpack")
    assert refused.exit_code == 2 and "--no-bitpack is an option of --trim" in refused.stderr
    # masks as bools: each ReLU result's 512 elements keep 512 B where bits keep 64 (4 * 4608 B)
    result = run("--budget", str(3 * 4608), "--trim", "--masks", "bytes", "--json", "plan.json", "--no-peak")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].endswith("held after the forward with gradaudit.trim (masks as bytes)")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["trim"] == {"bitpack": True, "masks": "bytes"}
    assert (data["held_bytes"], data["unplanned_held_bytes"]) == (3 * 4608, 4 * 4608)
    refused = run("--budget", "1MiB", "--masks", "bytes")
    assert refused.exit_code == 2 and "--masks is an option of --trim" in refused.stderr
    refused = run("--budget", "1MiB", "--trim", "--masks", "bit")
    assert refused.exit_code == 2 and "'bit' is not one of 'auto', 'bits', 'bytes'" in refused.stderr


def test_the_plans_step_is_the_training_loops_and_its_peaks_are_fits(tiny_hf_model):
    # a Hugging Face model given labels: the step backpropagates the output's loss (as fit does and
    # a training loop does), not every output with ones (the logits too, which no loop does); the
    # planned and unplanned peaks are then fit's peak less what is alive throughout (parameters,
    # buffers, the batch; plain SGD keeps no state and its step allocates nothing)
    model = tiny_hf_model("llama", num_hidden_layers=4, use_cache=False).train()
    ids = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    def rise(fitted):
        throughout = ("parameters", "buffers", "inputs", "optimizer_state", "workspaces")
        return fitted.peak_bytes - sum(fitted.breakdown[c] for c in throughout)

    unplanned = gradaudit.fit(model, batch, memory="1GiB", optimizer=torch.optim.SGD)
    chosen = gradaudit.plan(model, batch, unplanned.breakdown["activations"] // 2)
    assert chosen.checkpointed
    with chosen.apply(model):
        planned = gradaudit.fit(model, batch, memory="1GiB", optimizer=torch.optim.SGD)
    assert (chosen.peak_bytes, chosen.unplanned_peak_bytes) == (rise(planned), rise(unplanned))
    # a loss of the caller's own: the logits' sum (what the old step's ones amounted to for them)
    logits_sum = lambda output: output.logits.sum()  # noqa: E731
    own = gradaudit.plan(model, batch, unplanned.breakdown["activations"] // 2, loss=logits_sum)
    fitted = gradaudit.fit(model, batch, memory="1GiB", optimizer=torch.optim.SGD, loss=logits_sum)
    assert own.unplanned_peak_bytes == rise(fitted) != chosen.unplanned_peak_bytes


class _TwoHeads(nn.Module):
    """A body of blocks, a small head and a wide one: the loss may read either."""

    def __init__(self):
        super().__init__()
        self.blocks = mlp_stack(4, 64)
        self.small = nn.Linear(64, 8)
        self.wide = nn.Linear(64, 4096)

    def forward(self, x):
        h = self.blocks(x)
        return self.small(h), self.wide(h)


def test_the_steps_flops_are_the_training_loops_the_loss_backpropagated_not_every_output():
    from torch.utils.flop_counter import FlopCounterMode

    model, x = _TwoHeads(), torch.randn(32, 64)
    on_small = plan(model, x, "1GiB", loss=lambda out: out[0].sum())
    on_both = plan(model, x, "1GiB", loss=lambda out: out[0].sum() + out[1].sum())
    # the wide head's backward, two matrix products of 2 * 32 * 64 * 4096 FLOPs (its input's gradient
    # and its weight's), is in the step only when the loss reads the wide head
    wide_backward = 2 * (2 * 32 * 64 * 4096)
    assert on_both.step_flops - on_small.step_flops >= wide_backward
    # the step with the small head's loss: torch's own count of that loop's matrix products is within it
    with FlopCounterMode(display=False) as counter:
        model(x)[0].sum().backward()
    model.zero_grad(set_to_none=True)
    assert counter.get_total_flops() <= on_small.step_flops < counter.get_total_flops() + wide_backward


def test_the_flops_are_counted_in_the_unplanned_peak_step_as_in_a_step_of_their_own(tiny_hf_model, monkeypatch):
    """With its peaks measured (and no trim), a plan counts the FLOPs in the step that measures the
    unplanned peak: one forward and backward fewer, and the plan the same, field for field (every
    block's FLOPs, the step's, the unplanned peak), as where the FLOPs have a step of their own."""
    from gradaudit.planning import planner as planner_module

    model = tiny_hf_model("llama", num_hidden_layers=3, use_cache=False).train()
    ids = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    def planned() -> tuple[dict, list[str]]:
        said: list[str] = []
        return plan(model, batch, "1GiB", progress=said.append).to_dict(), said

    merged, merged_said = planned()
    chain = planner_module._chain
    monkeypatch.setattr(planner_module, "_chain", lambda *arguments: chain(*arguments[:8]))  # counted_in left out
    apart, apart_said = planned()
    assert merged == apart and merged["unplanned_peak_bytes"] > 0 and merged["step_flops"] > 0
    assert "counting FLOPs" in apart_said and "counting FLOPs" not in merged_said
    steps = [len([s for s in said if s.startswith("measuring the peak")]) for said in (merged_said, apart_said)]
    assert steps[0] == steps[1] - 1
    assert "counting FLOPs in a step with nothing checkpointed, its peak measured" in merged_said


@pytest.mark.parametrize("error", [0, 3, -3, 40, -40])
def test_a_guided_peak_search_finds_the_bisections_point(error):
    """``by_peak`` with a guess (fit's remedy predicts a point's peak from its bound and the nearest
    measured step's excess over its own): the same point as the bisection for every budget, where the
    peaks fall with the points; with a guess ``error`` points off either way it may take more probes, but
    never more than twice the bisection's; exact guesses take at most 4 (the two ends, the predicted
    first fit and the point before it)."""
    from gradaudit.planning.frontier import by_peak

    peaks = [1000 - 7 * i - (i * i) % 5 for i in range(120)]  # falls with the index, unevenly
    points = list(range(len(peaks)))
    for budget in range(peaks[-1] - 5, peaks[0] + 5, 3):
        probed: list[list[int]] = [[], []]

        def peak_of(i: int, probes: list[int]) -> int:
            probes.append(i)
            return peaks[i]

        plain = by_peak(points, budget, lambda i: peak_of(i, probed[0]), 0)
        guess = lambda i: peaks[min(max(i + error, 0), len(peaks) - 1)]  # noqa: E731  (another point's peak)
        guided = by_peak(points, budget, lambda i: peak_of(i, probed[1]), 0, guess)
        assert guided == plain, budget
        assert len(set(probed[1])) <= 2 * len(set(probed[0])), (budget, probed)
        if error == 0:
            assert len(set(probed[1])) <= 4, (budget, probed[1])


def _flops_both_ways(model, inputs, paths, monkeypatch, **options):
    """count_flops with gradaudit's counter, then with torch's FlopCounterMode (its fallback) forced."""
    from gradaudit.planning import costs

    light = costs.count_flops(model, inputs, None, None, "cpu", paths, **options)
    with monkeypatch.context() as patched:
        patched.setattr(costs, "_shared", lambda *_: True)
        full = costs.count_flops(model, inputs, None, None, "cpu", paths, **options)
    return light, full


@pytest.mark.parametrize("case", ["llama", "bert", "resnet18"])
def test_flops_counted_without_torchs_module_tracker_equal_its_count(case, tiny_hf_model, vision_model, monkeypatch):
    """The planner's FLOP counter (forward hooks on the candidate blocks only) gives torch's
    FlopCounterMode's figures, per block, kept by a selective checkpoint and for the whole step, on
    models nobody here wrote: a Llama (grouped attention, a padded mask, labels, half frozen), a BERT
    with dropout, a ResNet-18 (convolutions, batch norm in training); nested paths too."""
    if case == "resnet18":
        model, inputs = vision_model("resnet18").train(), torch.randn(2, 3, 32, 32)
        paths = ["conv1", "layer1", "layer1.0", "layer1.0.conv1", "layer4", "fc"]
    else:
        model = tiny_hf_model(case, **({"num_key_value_heads": 1} if case == "llama" else {})).train()
        ids = torch.randint(0, 100, (2, 16))
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 12:] = 0
        inputs = {"input_ids": ids, "attention_mask": mask}
        if case == "llama":
            inputs["labels"] = ids.masked_fill(mask == 0, -100)
            model.model.embed_tokens.requires_grad_(False)
            model.model.layers[0].requires_grad_(False)
        paths = [path for path, _ in model.named_modules() if path.count(".") <= 3 and path]
    light, full = _flops_both_ways(model, inputs, paths, monkeypatch)
    assert light == full
    assert light[1] > sum(light[0][p][0] for p in paths if p.count(".") == 0) > 0  # the step counts backward too
    assert any(kept > 0 for _, kept in light[0].values())  # products, convolutions: a selective checkpoint keeps


def test_flops_of_a_shared_block_and_of_a_higher_order_op_are_torchs_count(monkeypatch):
    """A module at two paths (the tracker names it by one) and a torch.cond in the forward (torch's
    mode counts higher-order ops its own way, which changed between releases): counted by torch's
    FlopCounterMode itself, with the same figures as forcing it."""
    from gradaudit.planning import costs

    class Branching(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            # (a branch on values that need no gradient: torch.cond has no eager backward on these releases)
            scale = torch.cond(x.detach().sum() > 0, lambda t: t * 2, lambda t: t + 1, (x.detach(),))
            return self.a(x) * scale

    shared = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    tied = nn.Sequential(shared, nn.Linear(8, 8), shared)
    x = torch.randn(4, 8, requires_grad=True)
    assert costs._shared(tied, ["0", "1"]) and not costs._shared(tied, ["1"])
    light, full = _flops_both_ways(tied, x, ["0", "1"], monkeypatch)
    assert light == full and light[0]["1"][0] == 2 * 4 * 8 * 8  # addmm: torch's formula counts the product
    handed_over = []
    monkeypatch.setattr(costs._Fallback, "__init__", lambda self, what: handed_over.append(what))
    light, full = _flops_both_ways(Branching(), x, ["a"], monkeypatch)
    assert handed_over and "cond" in handed_over[0]  # it reached the light counter, which handed the step over
    assert light == full


def test_blocks_passed_a_tensor_written_in_place_are_left_out_and_the_plan_trains(vision_model):
    """torchvision's MobileNetV3-Small, half frozen: its classifier's Hardswish and Dropout run in place
    on their inputs, which a checkpoint of them could not recompute (torch raises in backward: the plan's
    "every block" baseline did, measuring its peak). They are left out with a note saying why; the other
    candidates are planned, every peak is measured, and the plan applied trains with the same gradients."""
    model = vision_model("mobilenet_v3_small").train()
    for parameter in list(model.parameters())[: len(list(model.parameters())) // 2]:
        parameter.requires_grad_(False)
    x = torch.randn(2, 3, 64, 64)
    report = gradaudit.audit(model, x, watch=["classifier.0", "classifier.1", "classifier.2", "classifier.3"])
    assert [c.inputs_written for c in report.module_calls] == [False, True, True, False]
    free = gradaudit.plan(model, x, budget="1GiB")
    paths = [b["path"] for b in free.blocks]
    assert "classifier.1" not in paths and "classifier.2" not in paths and "classifier.0" in paths
    assert any(note.startswith("2 block(s) are passed a tensor written in place during or after their call "
                               "(classifier.1, classifier.2") for note in free.notes)
    assert all(b.peak_bytes > 0 for b in free.baselines)
    tight = gradaudit.plan(model, x, budget=free.unplanned_held_bytes - 1)
    assert tight.checkpointed and tight.held_bytes < free.unplanned_held_bytes

    def gradients():
        model.zero_grad()
        torch.manual_seed(1)  # (the classifier's dropout draws the same mask)
        model(x).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    plain = gradients()
    with tight.apply(model):
        planned = gradients()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))


def test_a_block_whose_input_a_later_op_writes_in_place_is_left_out():
    """The write need not be the block's own: a block whose input the model shifts in place after the
    call cannot be checkpointed either; its neighbours can."""
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))

        def forward(self, x):
            for i, block in enumerate(self.blocks):
                y = block(x)
                if i == 1:
                    x.mul_(0.5)  # block 1's input, written after its call
                x = y + x
            return x

    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 16, requires_grad=True)
    model.blocks[1][0].requires_grad_(False)  # (then nothing saves block 1's input: plain autograd runs)
    model(x).sum().backward()
    planned = gradaudit.plan(model, x, budget="1GiB")
    assert [b["path"] for b in planned.blocks] == ["blocks.0", "blocks.2", "blocks.3"]
    assert any("(blocks.1: an in-place module" in note for note in planned.notes)
