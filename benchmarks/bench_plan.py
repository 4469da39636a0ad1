"""The checkpoint planner, measured side by side in one run.

    python benchmarks/bench_plan.py            # Llama-style stacks on CPU (4, 16, 32 layers) and the 80-layer config on meta
    python benchmarks/bench_plan.py --quick    # the 4- and 16-layer stacks only
    python benchmarks/bench_plan.py --mincut   # also torch's min-cut partitioner (aot_eager) on the 4- and 8-layer stacks

For each model and budget (90/70/50/30/10% of the unplanned held bytes):
- predicted held bytes (``plan.held_bytes``) against a re-audit of the planned model (must be equal);
- on the CPU stacks, the peak the same model planned on the meta device predicts against the CPU's
  measured peak at the 30% budget (goal: the same plan, within 2%);
- the plan's extra FLOPs against the baselines a user would otherwise pick (every layer, every n-th
  layer) that hold at most as much: goal, never more than any of them; and against the plan that
  checkpoints whole blocks only (``selective=False``: what op-level checkpointing saves);
- planning time (``measure_peak=False``) as a ratio to one audit of the same model (both timed in
  this run); at the 30% budget, the peak of one step of the plan, of every-layer checkpointing and
  unplanned (``measure_peak=True``, which runs those steps); and the plan bounded by the peak
  (``bound="peak"``) at 60% of the unplanned peak, with its planning time.
With --mincut: torch.compile (backend aot_eager, no C++ compiler needed) with
``torch._functorch.config.activation_memory_budget`` at 1.0/0.7/0.5/0.3/0.1: the bytes its compiled
graph holds (gradaudit.audit of the compiled model), its FLOPs per step (FlopCounterMode counts
matrix products and attention, and, as the planner counts them, one per element every other op
writes) and its measured step time, beside gradaudit's plan for the same byte figure.
Op-level against whole-block recompute in time: one step with every layer checkpointed whole and
with every layer checkpointed op by op, on the hidden-128 stack and on a wider one (hidden 512,
2 x 512 tokens, 6 layers), medians of interleaved runs: the selective checkpoint's dispatch mode
costs a fixed time per op, which small tensors do not repay.
On the CPU stacks, the measured step time (forward + backward, one thread, medians of interleaved
runs) of the plan at the 30% budget against every-layer checkpointing and against no checkpointing, and
a plain-against-plain column: the ratio of two identical unplanned steps (the noise floor).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

FRACTIONS = (0.9, 0.7, 0.5, 0.3, 0.1)


def llama_stack(layers: int, device: str = "cpu", padded: bool = False):
    """A small stock Llama on ``device`` and its batch on the CPU (a meta model is given the CPU batch:
    its values decide what the mask code does). ``padded``: a training batch, an attention mask whose
    second row ends in 64 padding tokens and labels."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      use_cache=False)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").train()
    ids = torch.randint(0, 1000, (2, 256), generator=torch.Generator().manual_seed(0))
    if not padded:
        return model, {"input_ids": ids}
    mask = torch.ones(2, 256, dtype=torch.long)
    mask[1, -64:] = 0
    return model, {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def wide_llama_stack(layers: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=layers,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1000, use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    return model, {"input_ids": torch.randint(0, 1000, (2, 512))}


def bench_op_level(name: str, model, inputs, runs: int) -> None:
    from gradaudit.planning import PlanHandle

    layers = tuple(f"model.layers.{i}" for i in range(len(model.model.layers)))
    times: dict[str, list[float]] = {"plain": [], "whole": [], "op level": [], "plain again": []}
    step(model, inputs)
    for _ in range(runs):
        times["plain"].append(step(model, inputs))
        with PlanHandle(model, layers):
            times["whole"].append(step(model, inputs))
        with PlanHandle(model, layers, {path: "selective" for path in layers}):
            times["op level"].append(step(model, inputs))
        times["plain again"].append(step(model, inputs))
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"  {name}: plain {median['plain'] * 1e3:.0f} ms; every layer whole {median['whole'] / median['plain']:.2f}x, "
          f"op by op {median['op level'] / median['plain']:.2f}x, plain again "
          f"{median['plain again'] / median['plain']:.2f}x (noise)")


def bench_meta_prediction(layers: int) -> bool:
    import gradaudit
    from gradaudit.planning import plan
    from gradaudit.report.units import human_bytes

    model, inputs = llama_stack(layers, padded=True)
    budget = int(gradaudit.audit(model, inputs).saved_bytes * 0.3)
    measured = plan(model, inputs, budget)
    predicted = plan(*llama_stack(layers, "meta", padded=True), budget)
    same = predicted.checkpointed == measured.checkpointed and predicted.selective == measured.selective
    ratio = predicted.peak_bytes / measured.peak_bytes
    print(f"  {layers} layers: {'the same plan' if same else 'ANOTHER PLAN'}, peak on meta "
          f"{human_bytes(predicted.peak_bytes)}, on CPU {human_bytes(measured.peak_bytes)} ({ratio:.4f}x; goal: "
          f"within 2%)")
    return same and abs(ratio - 1) <= 0.02


def llama_80_on_meta():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import llama_probe

    return llama_probe.build()


def step(model, inputs) -> float:
    start = time.perf_counter()
    model(**inputs).logits.float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def bench(name: str, model, inputs, timed: bool, runs: int) -> bool:
    import gradaudit
    from gradaudit.planning import BudgetError, PlanHandle, plan
    from gradaudit.report.units import human_bytes

    start = time.perf_counter()
    unplanned = gradaudit.audit(model, inputs)
    audit_s = time.perf_counter() - start
    print(f"\n{name}: {human_bytes(unplanned.saved_bytes)} held unplanned, one audit {audit_s:.2f} s")
    print(f"  {'budget':>7} {'plan held':>11} {'re-audit':>11} {'equal':>5} {'+compute':>8} {'op-level':>8} "
          f"{'whole blocks':>12} {'best baseline (<= held)':>30} {'plan time':>10}")
    ok = True
    chosen_at = {}
    for fraction in FRACTIONS:
        budget = int(unplanned.saved_bytes * fraction)
        start = time.perf_counter()
        try:
            chosen = plan(model, inputs, budget, measure_peak=False)
        except BudgetError as error:
            print(f"  {fraction:>6.0%}  no plan fits (least {human_bytes(error.smallest)})")
            continue
        plan_s = time.perf_counter() - start
        whole = plan(model, inputs, budget, measure_peak=False, selective=False)
        with chosen.apply(model):
            again = gradaudit.audit(model, inputs).saved_bytes
        equal = again == chosen.held_bytes
        rivals = [b for b in chosen.baselines if b.name != "none" and b.held_bytes <= chosen.held_bytes]
        best = min(rivals, key=lambda b: b.extra_flops, default=None)
        beaten = best is None or chosen.extra_flops <= best.extra_flops
        ok = ok and equal and beaten and chosen.extra_flops <= whole.extra_flops
        rival = (f"{best.name} +{100 * best.extra_flops / chosen.step_flops:.1f}%" if best else "(none fits)")
        print(f"  {fraction:>6.0%} {human_bytes(chosen.held_bytes):>11} {human_bytes(again):>11} "
              f"{'yes' if equal else 'NO':>5} {100 * chosen.extra_compute:>7.1f}% "
              f"{len(chosen.selective):>3} of {len(chosen.checkpointed):>2} {100 * whole.extra_compute:>11.1f}% "
              f"{rival:>30} {plan_s:>5.2f} s {plan_s / audit_s:>4.1f}x")
        chosen_at[fraction] = chosen
    if 0.3 in chosen_at:
        start = time.perf_counter()
        measured = plan(model, inputs, int(unplanned.saved_bytes * 0.3))
        peak_s = time.perf_counter() - start
        every = next(b for b in measured.baselines if b.name == "every block")
        print(f"  peak of one step at the 30% budget ({'meta: shapes only' if measured.device == 'meta' else 'measured'}, "
              f"plan() with measure_peak {peak_s:.1f} s): plan {human_bytes(measured.peak_bytes)}, every layer "
              f"{human_bytes(every.peak_bytes)}, unplanned {human_bytes(measured.unplanned_peak_bytes)}")
        start = time.perf_counter()
        try:
            by_peak = plan(model, inputs, int(measured.unplanned_peak_bytes * 0.6), bound="peak")
            print(f"  bounded by the peak at 60% of the unplanned peak ({time.perf_counter() - start:.1f} s): peak "
                  f"{human_bytes(by_peak.peak_bytes)}, held {human_bytes(by_peak.held_bytes)}, "
                  f"+{100 * by_peak.extra_compute:.1f}% compute, {len(by_peak.checkpointed)} blocks")
        except BudgetError as error:
            print(f"  bounded by the peak at 60% of the unplanned peak: no plan fits (least peak "
                  f"{human_bytes(error.smallest)})")
    if timed and 0.3 in chosen_at:
        blocks = tuple(b["path"] for b in chosen_at[0.3].blocks)  # every layer: the same wrapper on all
        times: dict[str, list[float]] = {"plain": [], "plain again": [], "plan 30%": [], "every layer": []}
        step(model, inputs)
        for _ in range(runs):
            times["plain"].append(step(model, inputs))
            with chosen_at[0.3].apply(model):
                times["plan 30%"].append(step(model, inputs))
            with PlanHandle(model, blocks):
                times["every layer"].append(step(model, inputs))
            times["plain again"].append(step(model, inputs))
        median = {k: statistics.median(v) for k, v in times.items()}
        print(f"  CPU step, median of {runs} interleaved runs, {torch.get_num_threads()} thread(s): "
              f"plain {median['plain'] * 1e3:.0f} ms; plan 30% {median['plan 30%'] / median['plain']:.2f}x, "
              f"every layer {median['every layer'] / median['plain']:.2f}x, "
              f"plain again {median['plain again'] / median['plain']:.2f}x (noise)")
    return ok


def bench_mincut(layers: int, runs: int) -> None:
    import torch._functorch.config as functorch_config

    import gradaudit
    from gradaudit.planning import BudgetError, plan
    from gradaudit.planning.costs import counting
    from gradaudit.report.units import human_bytes

    warnings.simplefilter("ignore")  # dynamo's graph-break warnings (a builtin it cannot trace in the model)
    model, inputs = llama_stack(layers)
    ids = inputs["input_ids"]

    class LastHidden(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids).last_hidden_state

    eager = LastHidden(model.model)
    print(f"\nmin-cut partitioner vs gradaudit.plan, {layers} layers (aot_eager; time: median of {runs} steps)")
    print(f"  {'budget':>6} {'min-cut held':>12} {'FLOPs':>9} {'step':>8}   {'plan held':>10} {'+FLOPs':>8} {'step':>8}")
    for fraction in (1.0, 0.7, 0.5, 0.3, 0.1):
        torch._dynamo.reset()
        with functorch_config.patch(activation_memory_budget=fraction):
            compiled = LastHidden(torch.compile(model.model, backend="aot_eager"))
            held = gradaudit.audit(compiled, ids).saved_bytes
            with counting() as counter:  # as the planner counts: one per element where torch has no formula
                compiled(ids).float().pow(2).mean().backward()
            model.zero_grad(set_to_none=True)
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                compiled(ids).float().pow(2).mean().backward()
                times.append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
        mincut = statistics.median(times)
        try:
            chosen = plan(eager, ids, held, measure_peak=False)
        except BudgetError as error:
            print(f"  {fraction:>6.0%} {human_bytes(held):>12} {counter.get_total_flops():>9.3g} {mincut * 1e3:>6.0f} ms"
                  f"   no plan holds that little (least {human_bytes(error.smallest)})")
            continue
        times = []
        with chosen.apply(eager):
            for _ in range(runs):
                start = time.perf_counter()
                eager(ids).float().pow(2).mean().backward()
                times.append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
        print(f"  {fraction:>6.0%} {human_bytes(held):>12} {counter.get_total_flops():>9.3g} {mincut * 1e3:>6.0f} ms"
              f"   {human_bytes(chosen.held_bytes):>10} {100 * chosen.extra_compute:>7.1f}% "
              f"{statistics.median(times) * 1e3:>6.0f} ms")
    torch._dynamo.reset()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--mincut", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(1)
    ok = True
    for layers in (4, 16) if options.quick else (4, 16, 32):
        model, inputs = llama_stack(layers)
        ok &= bench(f"Llama-style stack, {layers} layers, hidden 128, batch 2 x 256 tokens, CPU", model, inputs,
                    timed=True, runs=options.runs)
    print("\npeak predicted on meta against measured on CPU (the same stock stack and padded training batch, "
          "planned at 30% of its held bytes on each device)")
    for layers in (4, 16):
        ok &= bench_meta_prediction(layers)
    if not options.quick:
        print(f"\nstep time, every layer checkpointed whole or op by op (CPU, one thread, medians of {options.runs} "
              f"interleaved runs)")
        bench_op_level("hidden 128, 2 x 256 tokens, 4 layers", *llama_stack(4), runs=options.runs)
        bench_op_level("hidden 512, 2 x 512 tokens, 6 layers", *wide_llama_stack(6), runs=options.runs)
        model, inputs = llama_80_on_meta()
        ok &= bench("80-layer Llama-2-70B config on meta, layer 40 trainable, 2048 tokens", model, inputs,
                    timed=False, runs=0)
    if options.mincut:
        for layers in (4, 8):
            bench_mincut(layers, options.runs)
    print("\nall re-audits equal and no baseline cheaper at equal or fewer held bytes" if ok else "\nGOAL MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
