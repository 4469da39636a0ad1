"""Benchmark gradaudit.trim on torchvision models in the five selective-differentiation scenarios.

For each model and scenario, measured side by side in one run:
- bytes autograd holds after the forward and peak bytes through forward+backward, plain vs trimmed
  (CPU: an independent storage tracker, gradaudit.measure.PeakTracker; CUDA:
  torch.cuda.max_memory_allocated). Parameters, buffers and the input are not counted;
- freed bytes (held plain - held trimmed) as a share of the audit's reclaimable_with_bitpacking_bytes
  (goal >= 95%);
- forward+backward time, trimmed / plain, with bit-packing, with masks kept as bools
  (``masks="bytes"``) and without either (drops only): median over interleaved
  repeats of the ratio of each variant's fastest step in a block of 3 (goal <= 1.05); and a second
  plain block / the first, which shows how far this machine's noise alone moves the ratio;
- the memsave study's published peak-memory reductions for the same scenario, on the models that
  study measured (ResNet-101, EfficientNet-v2-L): published figures for other models, not ours.

    python benchmarks/bench_trim.py            # small: batch 2, 64x64, a few minutes on 2 cores
    python benchmarks/bench_trim.py --full     # batch 8, 224x224
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torchvision
from torch import nn

import gradaudit
from gradaudit.scenarios import SCENARIOS, apply_scenario
from gradaudit.trimming import compare, trim

MODELS = {
    "ResNet-18": "resnet18",
    "ResNet-50": "resnet50",
    "EfficientNet-B0": "efficientnet_b0",
    "VGG-11-BN": "vgg11_bn",
    "MobileNet-V3-L": "mobilenet_v3_large",
}

# Published peak-memory reductions of memsave_torch (autograd-facts.md), per scenario, on the
# models that study measured. Not our models: shown for orientation only.
MEMSAVE = {
    "input-only": {"resnet": "R101 -33%", "efficientnet": "EffV2L -30%"},
    "input-only-bn-eval": {"resnet": "R101 -82%", "efficientnet": "EffV2L -61%"},
    "norm-only": {"resnet": "R101 -33%"},
    "surgical": {"resnet": "R101 -12%"},
}


def step(model: nn.Module, x: torch.Tensor) -> float:
    for p in model.parameters():
        p.grad = None
    x.grad = None
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    model(x).sum().backward()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_ratios(model: nn.Module, x: torch.Tensor, repeats: int) -> tuple[float, float, float, float, float]:
    """(plain seconds, ratio trimmed/plain, ratio trimmed with masks="bytes"/plain, ratio trimmed
    without bit-packing/plain, ratio of a second plain block to the first: what this machine's noise
    alone gives).

    Each repeat times a block of 3 steps per variant, back to back, and keeps each block's fastest
    step (the one least disturbed by other processes and by this VM's page-fault cost, which varies
    several-fold from minute to minute); each ratio is the median of the per-repeat ratios."""
    # plain, masks="bits" (trim()'s default on the CPU), masks="bytes", bitpack=False, plain
    variants = [None, "bits", "bytes", "drops", None]

    def block(how: object) -> float:
        if how is None:
            return min(step(model, x) for _ in range(3))
        options = {"bitpack": False} if how == "drops" else {"masks": how}
        with trim(model, **options):
            return min(step(model, x) for _ in range(3))

    for bitpack in variants:  # warm-up (allocator, kernels)
        block(bitpack)
    gc.collect()  # a pending full collection would land on whichever run allocates Python objects
    rows = [[block(bitpack) for bitpack in variants] for _ in range(repeats)]
    plain = statistics.median(r[0] for r in rows)
    return (plain, *(statistics.median(r[i] / r[0] for r in rows) for i in range(1, 5)))


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="batch 8 at 224x224 (slow on CPU)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5,
                        help="repeats of a 3-step block per variant (median of per-repeat ratios)")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    batch = args.batch or (8 if args.full else 2)
    size = args.size or (224 if args.full else 64)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, device {device}, "
          f"threads {torch.get_num_threads()}, input {batch}x3x{size}x{size}, {args.repeats} repeats of 3-step blocks")
    print("held/peak in MiB (activations, gradients and temporaries; parameters, buffers and the input "
          "not counted). freed% = freed / audit reclaimable_with_bitpacking_bytes.")
    header = ("| model | scenario | held plain | held trimmed | peak plain | peak trimmed | peak change "
              "| freed % of reclaimable | time trimmed/plain | time, masks=\"bytes\" | time, bitpack=False "
              "| time, plain again "
              "(noise) | memsave published (other model) |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    worst_freed, worst_time, worst_drop_only = 100.0, 0.0, 0.0
    for label in args.models:
        for scenario in args.scenarios:
            torch.manual_seed(0)
            model = getattr(torchvision.models, MODELS[label])(num_classes=10).to(device)
            x = torch.randn(batch, 3, size, size, device=device)
            apply_scenario(model, scenario, x)
            report = gradaudit.audit(model, x)
            measured = compare(model, x)
            reclaimable = report.reclaimable_with_bitpacking_bytes
            freed = measured["held_before"] - measured["held_after"]
            freed_share = 100.0 * freed / reclaimable if reclaimable else float("nan")
            plain_s, ratio, as_bytes, drop_only, noise = time_ratios(model, x, args.repeats)
            family = "efficientnet" if "efficientnet" in MODELS[label] else "resnet"
            published = MEMSAVE.get(scenario, {}).get(family, "-")
            peak_change = 100.0 * (measured["peak_after"] - measured["peak_before"]) / measured["peak_before"]
            if reclaimable:
                worst_freed = min(worst_freed, freed_share)
            worst_time = max(worst_time, ratio)
            worst_drop_only = max(worst_drop_only, drop_only)
            print(f"| {label} | {scenario} | {mib(measured['held_before'])} | {mib(measured['held_after'])} "
                  f"| {mib(measured['peak_before'])} | {mib(measured['peak_after'])} | {peak_change:+.0f}% "
                  f"| {f'{freed_share:.1f}% ({mib(freed)} of {mib(reclaimable)})' if reclaimable else 'nothing to reclaim'} "
                  f"| {ratio:.3f} ({plain_s * 1e3:.0f} ms plain) | {as_bytes:.3f} | {drop_only:.3f} | {noise:.3f} "
                  f"| {published} |", flush=True)
    print(f"\nworst freed share: {worst_freed:.1f}% (goal >= 95%); "
          f"worst time ratio: {worst_time:.3f}, without bit-packing {worst_drop_only:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
