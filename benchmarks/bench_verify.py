"""Cost of verify=True: audit time divided by a plain forward's time, CPU ResNet-50, one run.

Run: python benchmarks/bench_verify.py [--repeats 3] [--batch 4 --size 224]
Goal (issue 3): audit(verify=True) <= 6x a plain forward (same model, input and grad mode).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torchvision

import gradaudit


def block_seconds(fn, runs: int = 3) -> tuple[float, int]:
    """(seconds, minor page faults) of the fastest of ``runs`` back-to-back calls after one warm-up
    (allocator, oneDNN primitive caches). The fastest call is the one least disturbed by other
    processes and by this VM's page-fault cost, which varies several-fold from minute to minute."""
    fn()
    calls = []
    for _ in range(runs):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        fn()
        calls.append((time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    return min(calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    print(f"torch {torch.__version__}, ResNet-50, input {args.batch}x3x{args.size}x{args.size}, "
          f"{torch.get_num_threads()} threads, median over {args.repeats} repeats of the fastest of 3 calls")
    for label, train, frozen, input_grad in [("all-trainable, train mode", True, False, False),
                                             ("input-only, BN eval", False, True, True)]:
        model.train(train).requires_grad_(not frozen)
        x = torch.randn(args.batch, 3, args.size, args.size, requires_grad=input_grad)

        def forward():
            out = model(x)
            del out

        # Interleaved: each repeat times a block of forwards and blocks of audits back to back,
        # so load from other processes hits all three; the ratio is the median of the per-repeat
        # ratios.
        audit_plain = lambda: gradaudit.audit(model, x)  # noqa: E731
        audit_verified = lambda: gradaudit.audit(model, x, verify=True)  # noqa: E731
        rows = [(block_seconds(forward), block_seconds(audit_plain), block_seconds(audit_verified))
                for _ in range(args.repeats)]
        plain = statistics.median(r[0][0] for r in rows)
        static = statistics.median(r[1][0] / r[0][0] for r in rows)
        verified = statistics.median(r[2][0] / r[0][0] for r in rows)
        faults = [statistics.median(r[k][1] for r in rows) for k in range(3)]
        print(f"{label:<28} forward {plain * 1e3:8.1f} ms | audit {static:4.2f}x | "
              f"audit verify=True {verified:4.2f}x (goal <= 6x) | minor page faults per call: "
              f"forward {faults[0]:.0f}, audit {faults[1]:.0f}, verify {faults[2]:.0f}")

if __name__ == "__main__":
    main()
