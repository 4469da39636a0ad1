"""How much an audit costs, measured side by side in one run.

    python benchmarks/bench_audit.py            # both benchmarks
    python benchmarks/bench_audit.py resnet     # (a) only
    python benchmarks/bench_audit.py llama      # (b) only

(a) audit time / plain forward time, CPU ResNet-50 in train mode (goal <= 1.5x). Runs alternate
    (forward, audit, forward, audit, ...) so machine noise hits both; medians are compared.
(b) the 80-layer, 69B-parameter Llama config built on the meta device, input_ids (1, 2048) on meta,
    only model.layers.40.* trainable, audited end to end (model construction included) in a child
    process (goals: <= 15 s, <= 2 GiB peak RSS of that process).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

RESNET_GOAL = 1.5
LLAMA_SECONDS_GOAL = 15.0
LLAMA_RSS_GOAL_GIB = 2.0


def bench_resnet(runs: int, batch: int, size: int) -> bool:
    import torch
    import torchvision

    import gradaudit

    torch.manual_seed(0)
    model = torchvision.models.resnet50().train()
    x = torch.randn(batch, 3, size, size)
    forward_s, audit_s = [], []
    model(x)  # warm-up both paths once (allocator, lazy init)
    gradaudit.audit(model, x)
    for _ in range(runs):
        start = time.perf_counter()
        out = model(x)
        del out  # timed: the audit frees its own graph before returning
        forward_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        report = gradaudit.audit(model, x)
        audit_s.append(time.perf_counter() - start)
    forward, audit = statistics.median(forward_s), statistics.median(audit_s)
    ratio = audit / forward
    print(f"(a) ResNet-50 train, batch {batch}x3x{size}x{size}, {runs} interleaved runs, "
          f"{torch.get_num_threads()} threads")
    print(f"    plain forward median {forward:.3f} s  audit median {audit:.3f} s  "
          f"ratio {ratio:.2f}x (goal <= {RESNET_GOAL}x)  saved {report.saved_bytes / 2**20:.1f} MiB")
    return ratio <= RESNET_GOAL


_LLAMA_CHILD = """
import time
start = time.perf_counter()
import torch, transformers, gradaudit
config = transformers.LlamaConfig(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                                  intermediate_size=28672, num_hidden_layers=80, vocab_size=32000)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
built = time.perf_counter()
ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
report = gradaudit.audit(model, {"input_ids": ids}, trainable=["model.layers.40.*"])
done = time.perf_counter()
params = sum(p.numel() for p in model.parameters())
print(f"{params} {built - start:.3f} {done - built:.3f} {done - start:.3f} {report.saved_bytes} "
      f"{report.reclaimable_bytes} {report.reclaimable_with_bitpacking_bytes} {len(report.held_tensors)}")
"""


def bench_llama() -> bool:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", _LLAMA_CHILD], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        print(result.stderr[-3000:])
        raise SystemExit("(b) the Llama child process failed")
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    line = result.stdout.strip().splitlines()[-1].split()
    params, build_s, audit_s, total_s = int(line[0]), float(line[1]), float(line[2]), float(line[3])
    saved, reclaimable, bitpacked, held = (int(v) for v in line[4:8])
    print(f"(b) Llama {params / 1e9:.1f}B parameters, 80 layers, seq 2048, meta, only model.layers.40.* trainable")
    print(f"    imports+build {build_s:.2f} s  audit {audit_s:.2f} s  in-process total {total_s:.2f} s  "
          f"child wall {wall:.2f} s (goal <= {LLAMA_SECONDS_GOAL:.0f} s)")
    print(f"    peak RSS {peak_gib:.2f} GiB (goal <= {LLAMA_RSS_GOAL_GIB:.0f} GiB)  saved {saved / 2**30:.2f} GiB "
          f"in {held} tensors  reclaimable {reclaimable / 2**30:.2f} GiB  "
          f"with bit-packing {bitpacked / 2**30:.2f} GiB")
    return wall <= LLAMA_SECONDS_GOAL and peak_gib <= LLAMA_RSS_GOAL_GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="*", help="resnet and/or llama (default: both)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    which = args.which or ["resnet", "llama"]
    if set(which) - {"resnet", "llama"}:
        parser.error("choose from: resnet, llama")
    ok = True
    if "llama" in which:  # first: a child forked from a big parent may count its pages before exec
        ok &= bench_llama()
    if "resnet" in which:
        ok &= bench_resnet(args.runs, args.batch, args.size)
    print("all goals met" if ok else "GOAL MISSED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
