"""Static rules vs the empirical proof: reclaimable bytes on torchvision models, several freezing scenarios.

Run: python benchmarks/static_vs_proven.py [--batch 2] [--size 128]
Goal (issue 3): ResNet-18 input-only with eval-mode batch norm, static >= 90% of proven.
Scenarios: gradaudit.scenarios (the ones bench_trim uses; surgical = the first third of the layers
with weights trainable).
"""

from __future__ import annotations

import argparse

import torch
import torchvision

import gradaudit
from gradaudit.scenarios import SCENARIOS, apply_scenario

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--models", default="resnet18,resnet50,mobilenet_v3_small,efficientnet_b0")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, input {args.batch}x3x{args.size}x{args.size}, CPU")
    print(f"{'model':<20} {'scenario':<22} {'saved':>10} {'static':>10} {'proven':>10} {'%':>6}"
          f" {'static+bits':>12} {'proven+bits':>12}")
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)()
        for label in SCENARIOS:
            x = torch.randn(args.batch, 3, args.size, args.size)
            apply_scenario(model, label, x)
            static = gradaudit.audit(model, x)
            proven = gradaudit.audit(model, x, verify=True)
            share = 100.0 * static.reclaimable_bytes / proven.reclaimable_bytes if proven.reclaimable_bytes else 100.0
            print(f"{name:<20} {label:<22} {static.saved_bytes / 2**20:>9.2f}M "
                  f"{static.reclaimable_bytes / 2**20:>9.2f}M {proven.reclaimable_bytes / 2**20:>9.2f}M "
                  f"{share:>5.1f}% {static.reclaimable_with_bitpacking_bytes / 2**20:>11.2f}M "
                  f"{proven.reclaimable_with_bitpacking_bytes / 2**20:>11.2f}M")
            bugs = [d.message() for d in proven.disagreements]
            if bugs:
                print("   ", *bugs, sep="\n    ")


if __name__ == "__main__":
    main()
