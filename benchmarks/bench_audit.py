"""How much an audit costs, measured side by side in one run.

    python benchmarks/bench_audit.py            # both benchmarks
    python benchmarks/bench_audit.py resnet     # (a) only
    python benchmarks/bench_audit.py llama      # (b) only
    python benchmarks/bench_audit.py small      # (c) only (not part of the default run)
    python benchmarks/bench_audit.py nomem      # (d) only (not part of the default run: minutes of CPU forwards)

(a) audit time / plain forward time, CPU ResNet-50 in train mode (goal <= 1.5x). Runs alternate
    (forward, audit, forward, audit, ...) so machine noise hits both; medians are compared.
(b) the stock 80-layer, 69B-parameter LlamaForCausalLM built on the meta device (use_cache=False, SDPA),
    a training batch on the CPU (input_ids (1, 2048), an attention mask ending in 64 padding tokens,
    labels), only model.layers.40.* trainable, audited end to end (model construction included) in a
    child process (goals: <= 15 s, <= 2 GiB peak RSS of that process).
(c) the fixed cost at small sizes (what unit tests calling assert_no_waste pay): audit time / plain
    forward time for a 2-layer MLP at batch 4, a small conv block, ResNet-18 at 1x3x32x32 and a
    tiny BERT from config, one thread, runs interleaved (forward, forward, audit); the forward
    median pools both plain forwards, the "noise" column is the median ratio of the second plain
    forward to the first (how far apart two identical measurements land in this run).
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
                                  intermediate_size=28672, num_hidden_layers=80, vocab_size=32000,
                                  use_cache=False)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").train()
built = time.perf_counter()
ids = torch.zeros(1, 2048, dtype=torch.long)
mask = torch.ones(1, 2048, dtype=torch.long)
mask[:, -64:] = 0
batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
report = gradaudit.audit(model, batch, trainable=["model.layers.40.*"])
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


def _small_models():
    import torch
    from torch import nn

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    yield "mlp 2-layer, batch 4", mlp, torch.randn(4, 16)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
    yield "conv block, 2x3x16x16", conv.train(), torch.randn(2, 3, 16, 16)
    try:
        import torchvision
        yield "resnet18 eval, 1x3x32x32", torchvision.models.resnet18().eval(), torch.randn(1, 3, 32, 32)
    except ImportError:
        pass
    try:
        import transformers
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, vocab_size=100, max_position_embeddings=64)
        bert = transformers.BertModel(config).train()
        yield "tiny bert train, ids 2x16", bert, {"input_ids": torch.randint(0, 100, (2, 16))}
    except ImportError:
        pass


def bench_small(runs: int) -> bool:
    import torch

    import gradaudit
    from gradaudit.tensors import split_inputs

    torch.set_num_threads(1)
    print(f"(c) small sizes, {runs} interleaved runs each, 1 thread: median audit / plain forward")
    print(f"    {'model':<28} {'forward ms':>10} {'audit ms':>9} {'ratio':>7} {'noise':>7}")
    ratios = []
    for name, model, inputs in _small_models():
        args, kwargs = split_inputs(inputs)
        model(*args, **kwargs)
        gradaudit.audit(model, inputs)
        forward_s, audit_s, noise = [], [], []
        for _ in range(runs):
            start = time.perf_counter()
            out = model(*args, **kwargs)
            del out
            first = time.perf_counter() - start
            start = time.perf_counter()
            out = model(*args, **kwargs)
            del out
            second = time.perf_counter() - start
            start = time.perf_counter()
            gradaudit.audit(model, inputs)
            audit_s.append(time.perf_counter() - start)
            forward_s += [first, second]
            noise.append(second / first)
        forward, audit = statistics.median(forward_s), statistics.median(audit_s)
        ratios.append(audit / forward)
        print(f"    {name:<28} {forward * 1e3:10.2f} {audit * 1e3:9.2f} {audit / forward:6.2f}x "
              f"{statistics.median(noise):6.2f}x")
    print(f"    median ratio over models {statistics.median(ratios):.2f}x")
    return True


NOMEM_GOAL = 0.5


def _nomem_models():
    import torch

    def resnet(device):
        import torchvision
        torch.manual_seed(0)
        with torch.device(device):
            return torchvision.models.resnet50().train()

    def gpt2(device):
        import transformers
        # attention dropout off: with it the CPU runs its math kernel, whose 8x12x1024x1024 probabilities
        # and dropout masks (9.7 GB over 12 layers) held twice (the audit measures the what-if without
        # it beside the first forward's graph) exceed this 24 GiB machine
        config = transformers.GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024, use_cache=False,
                                         attn_pdrop=0.0)
        with torch.device(device):
            return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa").train()

    ids = torch.randint(0, 50257, (8, 1024), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(8, 1024, dtype=torch.long)
    mask[1::2, -128:] = 0  # every other sequence ends in padding, as a collator pads a batch
    text = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    yield "ResNet-50 train, 8x3x224x224", resnet, torch.randn(8, 3, 224, 224)
    yield "GPT-2 small train, 8x1024 padded", gpt2, text


def bench_nomem(runs: int) -> bool:
    import torch

    import gradaudit
    from gradaudit.tensors import split_inputs

    print(f"(d) no-memory audit at training sizes, {runs} interleaved runs, {torch.get_num_threads()} threads")
    print(f"    {'model':<34} {'forward s':>9} {'cpu audit s':>11} {'meta audit s':>12} {'meta/fwd':>8} "
          f"{'meta/cpu':>8} {'noise':>6}")
    ok = True
    for name, build, inputs in _nomem_models():
        cpu_model, meta_model = build("cpu"), build("meta")
        args, kwargs = split_inputs(inputs)
        forward_s, cpu_s, meta_s, noise = [], [], [], []
        for _ in range(runs):
            times = []
            for _ in range(2):
                start = time.perf_counter()
                out = cpu_model(*args, **kwargs)
                del out
                times.append(time.perf_counter() - start)
            start = time.perf_counter()
            on_cpu = gradaudit.audit(cpu_model, inputs)
            cpu_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            on_meta = gradaudit.audit(meta_model, inputs)
            meta_s.append(time.perf_counter() - start)
            forward_s += times
            noise.append(times[1] / times[0])
            assert (on_meta.saved_bytes, on_meta.reclaimable_bytes) == (on_cpu.saved_bytes, on_cpu.reclaimable_bytes)
        forward, cpu, meta = (statistics.median(v) for v in (forward_s, cpu_s, meta_s))
        ok &= meta / forward <= NOMEM_GOAL
        print(f"    {name:<34} {forward:9.2f} {cpu:11.2f} {meta:12.2f} {meta / forward:7.2f}x {meta / cpu:7.2f}x "
              f"{statistics.median(noise):5.2f}x  held {on_meta.saved_bytes / 2**20:.0f} MiB (equal on both)")
    print(f"    goal: meta audit <= {NOMEM_GOAL}x a plain CPU forward")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="*", help="resnet, llama, small and/or nomem (default: resnet and llama)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    which = args.which or ["resnet", "llama"]
    if set(which) - {"resnet", "llama", "small", "nomem"}:
        parser.error("choose from: resnet, llama, small, nomem")
    ok = True
    if "llama" in which:  # first: a child forked from a big parent may count its pages before exec
        ok &= bench_llama()
    if "resnet" in which:
        ok &= bench_resnet(args.runs, args.batch, args.size)
    if "small" in which:
        ok &= bench_small(max(args.runs, 5) if args.runs != 5 else 30)
    if "nomem" in which:
        ok &= bench_nomem(min(args.runs, 3))
    print("all goals met" if ok else "GOAL MISSED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
