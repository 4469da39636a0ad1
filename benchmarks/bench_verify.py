"""Cost of verify=True: audit time divided by a plain forward's time, CPU ResNet-50, one run.

Run: python benchmarks/bench_verify.py [--repeats 5]
Goal (issue 3): audit(verify=True) <= 6x a plain forward (same model, input and grad mode).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision

import gradaudit


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, oneDNN primitive caches)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    print(f"torch {torch.__version__}, ResNet-50, input {args.batch}x3x{args.size}x{args.size}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    for label, train, frozen, input_grad in [("all-trainable, train mode", True, False, False),
                                             ("input-only, BN eval", False, True, True)]:
        model.train(train).requires_grad_(not frozen)
        x = torch.randn(args.batch, 3, args.size, args.size, requires_grad=input_grad)

        def forward():
            out = model(x)
            del out

        # Interleaved: each repeat times a forward and an audit back to back, so load from other
        # processes hits both; the ratio is the median of the per-repeat ratios.
        audit_plain = lambda: gradaudit.audit(model, x)  # noqa: E731
        audit_verified = lambda: gradaudit.audit(model, x, verify=True)  # noqa: E731
        rows = [(median_seconds(forward, 1), median_seconds(audit_plain, 1), median_seconds(audit_verified, 1))
                for _ in range(args.repeats)]
        plain = statistics.median(r[0] for r in rows)
        static = statistics.median(r[1] / r[0] for r in rows)
        verified = statistics.median(r[2] / r[0] for r in rows)
        print(f"{label:<28} forward {plain * 1e3:8.1f} ms | audit {static:4.2f}x | "
              f"audit verify=True {verified:4.2f}x (goal <= 6x)")

if __name__ == "__main__":
    main()
