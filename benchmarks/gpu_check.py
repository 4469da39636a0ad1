"""gradaudit's CUDA figures against a real GPU, in one run of a few minutes (the device check of the
"Every torch users run" work): run it on the GPU machine's own torch, from a source tree.

    PYTHONPATH=. python benchmarks/gpu_check.py OUT_DIR [--budget 420] [--sections facts,zoo,fit,trim] [--cases ...]

Sections, each writing ``OUT_DIR/<section>.json`` as it goes and printing a table:

- facts: the GPU, its torch, cuDNN and what gradaudit assumes for it; the autograd nodes a Linear on a
  3-D input makes on the GPU and on the CPU (contiguous and transposed), which the emulation must copy.
- zoo: every architecture of tests/hf_zoo.py, fp32 and bf16, with a padded mask and with ids alone
  (half the parameters frozen): ``audit(model on meta, batch, target="cuda")`` against ``audit`` of
  the same model on the GPU: saved, reclaimable and bit-packing bytes, and every saved tensor's
  (node, attribute, shape, dtype).
- fit: ``fit(model on meta, target="cuda").peak_bytes`` against ``torch.cuda.max_memory_allocated``
  over a steady-state step (after a warm-up step; cuBLAS's workspaces freed before the model is
  moved to the GPU, so the step's own are counted), on CNNs, decoders and encoders in fp32 and bf16, a
  LoRA model. Models are built on the CPU and moved, as loading a checkpoint allocates them.
- gaps: what the allocator counts beyond the tensors (parameters built on the GPU and moved there),
  cuDNN's per-call convolution workspaces, and SegFormer's audit on meta against the GPU's.
- fitcuda: ``fit`` of the model on the GPU against ``fit`` on meta for CUDA.
- profile: cProfile of trimmed steps. determinism: trimmed gradients against plain ones with
  deterministic kernels (run it with CUBLAS_WORKSPACE_CONFIG=:4096:8).
- trim: held bytes after the forward, peak bytes through forward+backward and step time, plain
  against ``gradaudit.trim`` and (on the CNN) memsave_torch, when ``.dev/memsave`` holds its source:
  ResNet-50 at 32x224 in the memsave study's scenarios, a bf16 Llama probed, norm-tuned and LoRA-tuned.
  Times are medians over interleaved repeats of each variant's fastest step in a block of 3, with a
  second plain block against the first as the noise floor. Trimmed gradients are compared with plain ones.
  Where Triton is installed, trim(kernels="triton") too (one fused kernel to pack a save's bits, one to
  unpack them): its step time against plain, and its gradients against plain ones. Per variant, from
  torch.profiler over steady steps: kernels launched, GPU busy time and span, saves changed, and host
  syncs (``set_sync_debug_mode("warn")``); a gzipped trace for two cases. A BERT with dropout.
- codec: ways to pack and unpack a ReLU result's bits on the GPU side by side, and a bool dropout mask's
  (GPU and host time per call), and what a saved tensor's register_hooks and a forward hook cost on the host.
- compiled: compiled models (ResNet-18 under aot_eager and inductor, a GPT-2 under inductor) on the GPU:
  regions and held bytes counted off the step's graph and the allocator against the audit, every save's
  record, verify=True; the same model on meta for CUDA; and an eager verify=True on the GPU's kernels.

``--cases a,b``: only the trim and compiled cases whose names hold one of the substrings.
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.utils._python_dispatch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / ".dev" / "memsave"))

import gradaudit  # noqa: E402

MIB = 2**20
CASES: list = []  # --cases: substrings; a trim or compiled case runs when its name holds one (empty: all)


def wanted(name: str) -> bool:
    return not CASES or any(part in name for part in CASES)
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def fresh() -> None:
    """Nothing of an earlier case left in the allocator, the cuBLAS workspaces included."""
    gc.collect()
    if CUDA:
        sync()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def peak_allocated() -> int:
    return torch.cuda.max_memory_allocated() if CUDA else 0


def reset_peak() -> None:
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


def write(out: Path, name: str, data: object) -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def chain(tensor: torch.Tensor, depth: int = 5) -> list[str]:
    names, fn = [], tensor.grad_fn
    while fn is not None and len(names) < depth:
        names.append(type(fn).__name__)
        nxt = [f for f, _ in fn.next_functions if f is not None and type(f).__name__ != "AccumulateGrad"]
        fn = nxt[0] if nxt else None
    return names


# ---------------------------------------------------------------------------------------------- facts

def facts(out: Path, budget: Budget) -> None:
    from gradaudit.cuda_choices import assumed_gpu
    data: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                  "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                  "gpu": torch.cuda.get_device_name() if CUDA else None,
                  "capability": torch.cuda.get_device_capability() if CUDA else None}
    try:
        data["assumed"] = repr(assumed_gpu())
    except Exception as error:  # noqa: BLE001
        data["assumed"] = f"{type(error).__name__}: {error}"
    lines = {}
    for device in ("cpu", DEVICE):
        for dtype in (torch.float32, torch.bfloat16):
            lin = torch.nn.Linear(64, 32).to(device=device, dtype=dtype)
            for layout, x in (("contiguous 3-D", torch.randn(2, 5, 64)),
                              ("transposed 3-D", torch.randn(2, 64, 5).transpose(1, 2)),
                              ("flatten(2).transpose(1,2)", torch.randn(2, 64, 5, 1).flatten(2).transpose(1, 2)),
                              ("contiguous 4-D", torch.randn(2, 3, 5, 64)),
                              ("permuted 4-D", torch.randn(2, 64, 3, 5).permute(0, 2, 3, 1))):
                x = x.to(device=device, dtype=dtype).requires_grad_()
                lines[f"{device} {str(dtype)[6:]} {layout}"] = chain(lin(x))
    data["linear"] = lines
    write(out, "facts", data)
    print(json.dumps(data, indent=1, default=str), flush=True)


# ------------------------------------------------------------------------------------------------ zoo

def _cast(batch: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def _figures(report) -> dict:
    return {"saved": report.saved_bytes, "reclaimable": report.reclaimable_bytes,
            "bitpacking": report.reclaimable_with_bitpacking_bytes,
            "tensors": collections.Counter((t.node, t.attr, tuple(t.shape), str(t.dtype)) for t in report.tensors)}


def zoo(out: Path, budget: Budget) -> None:
    import transformers
    from hf_zoo import ARCHS, batch, build_model
    rows, mismatches = [], 0
    print("| model | dtype | batch | saved meta-as-cuda | saved GPU | equal | differing nodes |", flush=True)
    for arch in ARCHS:
        for dtype in (torch.float32, torch.bfloat16):
            for padded in (True, False):
                if budget.left() < 0:
                    rows.append({"model": arch.name, "skipped": "budget"})
                    continue
                row = {"model": arch.name, "dtype": str(dtype)[6:], "padded": padded}
                try:
                    fresh()
                    gpu_model = build_model(arch, transformers, device=DEVICE).to(dtype)
                    names = [n for n, _ in gpu_model.named_parameters()]
                    frozen = None if padded else names[: len(names) // 2]
                    on_gpu = _figures(gradaudit.audit(gpu_model, _cast(batch(arch, padded, DEVICE), dtype),
                                                      frozen=frozen))
                    del gpu_model
                    meta_model = build_model(arch, transformers, device="meta").to(dtype)
                    on_meta = _figures(gradaudit.audit(meta_model, _cast(batch(arch, padded), dtype), frozen=frozen,
                                                       target="cuda"))
                    only_gpu = on_gpu["tensors"] - on_meta["tensors"]
                    only_meta = on_meta["tensors"] - on_gpu["tensors"]
                    equal = all(on_gpu[k] == on_meta[k] for k in on_gpu)
                    mismatches += not equal
                    row.update(saved_meta=on_meta["saved"], saved_gpu=on_gpu["saved"],
                               reclaimable_meta=on_meta["reclaimable"], reclaimable_gpu=on_gpu["reclaimable"],
                               bitpacking_meta=on_meta["bitpacking"], bitpacking_gpu=on_gpu["bitpacking"],
                               equal=equal, only_gpu=sorted(only_gpu.items()), only_meta=sorted(only_meta.items()))
                    gpu_nodes = sorted({k[0] for k in only_gpu})
                    meta_nodes = sorted({k[0] for k in only_meta})
                    print(f"| {arch.name} | {row['dtype']} | {'padded' if padded else 'ids'} | {on_meta['saved']} "
                          f"| {on_gpu['saved']} | {equal} | {'' if equal else f'GPU {gpu_nodes} / meta {meta_nodes}'} |",
                          flush=True)
                except Exception as error:  # noqa: BLE001
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    print(f"| {arch.name} | {row['dtype']} | {padded} | error: {row['error']} |", flush=True)
                rows.append(row)
                write(out, "zoo", rows)
    done = [r for r in rows if "equal" in r]
    print(f"zoo: {sum(r['equal'] for r in done)} of {len(done)} audits equal; "
          f"{sum('error' in r for r in rows)} errors; {sum('skipped' in r for r in rows)} skipped", flush=True)


# ------------------------------------------------------------------------------------------------ fit

def _hf(name: str, dtype: torch.dtype, **config):
    def build(device: str):
        import transformers
        torch.manual_seed(0)
        cls = getattr(transformers, name)
        with torch.device(device):
            model = cls._from_config(cls.config_class(use_cache=False, **config), attn_implementation="sdpa")
        return model.to(dtype).train()
    return build


def _text_batch(vocab: int, batch: int, sequence: int, padded: bool = True):
    def make(device: str) -> dict:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, vocab, (batch, sequence), generator=g)
        out = {"input_ids": ids, "labels": ids.clone()}
        if padded:
            mask = torch.ones(batch, sequence, dtype=torch.long)
            mask[1, sequence // 2:] = 0
            out["attention_mask"] = mask
            out["labels"] = ids.masked_fill(mask == 0, -100)
        return {k: v.to(device) if device != "meta" else v for k, v in out.items()}
    return make


def _vision(name: str):
    def build(device: str):
        import torchvision
        torch.manual_seed(0)
        with torch.device(device):
            return getattr(torchvision.models, name)(num_classes=1000).train()
    return build


def _pixels(batch: int, size: int, dtype: torch.dtype = torch.float32):
    def make(device: str):
        x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)).to(dtype)
        return x.to(device) if device != "meta" else x.to("meta")
    return make


def _lora(build_base):
    def build(device: str):
        import peft
        model = build_base(device)
        return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    return build


LLAMA = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=2048)
FIT_CASES = [
    # name, build(device), batch(device), optimizer, loss
    ("ResNet-18 32x224 fp32 SGD+momentum", _vision("resnet18"), _pixels(32, 224), "sgd", "sum"),
    ("ResNet-50 32x224 fp32 AdamW", _vision("resnet50"), _pixels(32, 224), "adamw", "sum"),
    ("ViT-B/16 16x224 fp32 AdamW", _vision("vit_b_16"), _pixels(16, 224), "adamw", "sum"),
    ("Llama 8x1024 bf16 4x1024 padded AdamW", _hf("LlamaForCausalLM", torch.bfloat16, **LLAMA),
     _text_batch(32000, 4, 1024), "adamw", "loss"),
    ("Llama 8x1024 fp32 4x512 ids AdamW", _hf("LlamaForCausalLM", torch.float32, **LLAMA),
     _text_batch(32000, 4, 512, padded=False), "adamw", "loss"),
    ("Llama LoRA r16 bf16 4x1024 padded AdamW", _lora(_hf("LlamaForCausalLM", torch.bfloat16, **LLAMA)),
     _text_batch(32000, 4, 1024), "adamw", "loss"),
    ("GPT-2 6x768 fp32 8x512 padded AdamW", _hf("GPT2LMHeadModel", torch.float32, n_layer=6, n_embd=768, n_head=12),
     _text_batch(50257, 8, 512), "adamw", "loss"),
    ("BERT 6x768 bf16 8x512 padded AdamW", _hf("BertForMaskedLM", torch.bfloat16, num_hidden_layers=6),
     _text_batch(30522, 8, 512), "adamw", "loss"),
    ("Qwen2 4x896 bf16 4x1024 ids AdamW", _hf("Qwen2ForCausalLM", torch.bfloat16, vocab_size=151936, hidden_size=896,
                                               intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
                                               num_key_value_heads=2, tie_word_embeddings=True),
     _text_batch(151936, 4, 1024, padded=False), "adamw", "loss"),
]


def _loss(kind: str):
    return (lambda output: output.loss) if kind == "loss" else (lambda output: output.float().sum())


def _inputs_kwargs(batch):
    return ((), batch) if isinstance(batch, dict) else ((batch,), {})


def _fit_on_meta(build, make_batch, optimizer_name: str, loss_fn):
    """``fit`` of the case built on meta for CUDA (no remedy), and the seconds it took."""
    start = time.perf_counter()
    fitted = gradaudit.fit(build("meta"), make_batch("meta"), memory="80GiB", target="cuda",
                           optimizer=optimizer_name, loss=loss_fn, remedy=False)
    return fitted, time.perf_counter() - start


def _measure_step(model, batch, optimizer_name: str, loss_fn) -> dict:
    args, kwargs = _inputs_kwargs(batch)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params) if optimizer_name == "adamw" else torch.optim.SGD(params, lr=0.01, momentum=0.9)
    for step in range(2):
        if step == 1:
            sync()
            start_bytes = allocated()
            reset_peak()
            t0 = time.perf_counter()
        loss = loss_fn(model(*args, **kwargs))
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    seconds = time.perf_counter() - t0
    return {"peak": peak_allocated(), "start": start_bytes, "step_s": seconds,
            "reserved": torch.cuda.max_memory_reserved() if CUDA else 0}


def fit(out: Path, budget: Budget) -> None:
    rows = []
    print("| case | fit peak (meta as cuda) | GPU max_memory_allocated | error | fit rise | GPU rise | "
          "workspaces | fit s | GPU step s |", flush=True)
    for name, build, make_batch, optimizer_name, loss_kind in FIT_CASES:
        if budget.left() < 0:
            rows.append({"case": name, "skipped": "budget"})
            continue
        row: dict = {"case": name}
        try:
            loss_fn = _loss(loss_kind)
            fitted, row["fit_s"] = _fit_on_meta(build, make_batch, optimizer_name, loss_fn)
            row["fit_peak"] = fitted.peak_bytes
            row["breakdown"] = dict(fitted.breakdown)
            row["fit_reserved"] = fitted.reserved_bytes
            persistent = sum(row["breakdown"].get(k, 0) for k in ("parameters", "buffers", "inputs", "optimizer_state"))
            fresh()
            base = allocated()
            # built on the CPU and moved, one storage after another, as loading a checkpoint does (fit
            # replays the allocator in that order; a model built on the GPU in float32 and cast
            # leaves other blocks behind)
            model = build("cpu").to(DEVICE)
            measured = _measure_step(model, make_batch(DEVICE), optimizer_name, loss_fn)
            del model
            row.update(gpu_peak=measured["peak"] - base, gpu_start=measured["start"] - base,
                       gpu_step_s=measured["step_s"], gpu_reserved=measured["reserved"])
            row["error_pct"] = 100.0 * (row["fit_peak"] - row["gpu_peak"]) / max(row["gpu_peak"], 1)
            row["fit_rise"] = row["fit_peak"] - persistent - row["breakdown"].get("workspaces", 0)
            row["gpu_rise"] = row["gpu_peak"] - row["gpu_start"]
            print(f"| {name} | {row['fit_peak']:,} | {row['gpu_peak']:,} | {row['error_pct']:+.3f}% | "
                  f"{row['fit_rise']:,} | {row['gpu_rise']:,} | {row['breakdown'].get('workspaces', 0):,} | "
                  f"{row['fit_s']:.1f} | {row['gpu_step_s']:.3f} |", flush=True)
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            print(f"| {name} | error: {row['error']} |", flush=True)
            traceback.print_exc(limit=3)
        rows.append(row)
        write(out, "fit", rows)


# ----------------------------------------------------------------------------------------------- trim

def _step(model, args, kwargs, loss_fn) -> float:
    for p in model.parameters():
        p.grad = None
    sync()
    t0 = time.perf_counter()
    loss_fn(model(*args, **kwargs)).backward()
    sync()
    return time.perf_counter() - t0


def _held_peak(model, args, kwargs, loss_fn) -> tuple[int, int]:
    for p in model.parameters():
        p.grad = None
    for t in args:
        if isinstance(t, torch.Tensor):
            t.grad = None
    fresh()
    base = allocated()
    loss = loss_fn(model(*args, **kwargs))
    sync()
    held = allocated() - base
    loss.backward()
    del loss
    sync()
    peak = peak_allocated() - base
    return held, peak


def _grads(model, args) -> list:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None] + \
        [t.grad.clone() for t in args if isinstance(t, torch.Tensor) and t.grad is not None]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _variants(model, memsave_model):
    from gradaudit.trimming import trim
    from gradaudit.trimming import fused
    # "trim": its masks as bits; trim's default on a GPU (masks="auto") is the "trim bytes" row
    variants = {"plain": (model, None), "trim": (model, lambda: trim(model, masks="bits")),
                "trim bytes": (model, lambda: trim(model, masks="bytes"))}
    if fused.installed():
        # the bits packed and unpacked by one fused Triton kernel each way (the same bytes as "trim")
        variants["trim triton"] = (model, lambda: trim(model, kernels="triton"))
    if memsave_model is not None:
        variants["memsave"] = (memsave_model, None)
    return variants


def _time_variants(variants: dict, args, kwargs, loss_fn, repeats: int) -> dict:
    import contextlib
    order = [*variants, "plain again"]

    def block(key: str) -> float:
        model, context = variants["plain" if key == "plain again" else key]
        with (context() if context else contextlib.nullcontext()):
            return min(_step(model, args, kwargs, loss_fn) for _ in range(3))

    for key in order:
        block(key)
    rows = [{key: block(key) for key in order} for _ in range(repeats)]
    out = {"plain_ms": 1e3 * statistics.median(r["plain"] for r in rows)}
    for key in order[1:]:
        out[f"{key}/plain"] = statistics.median(r[key] / r["plain"] for r in rows)
    return out


def _trim_case(name: str, model, memsave_model, args, kwargs, loss_fn, repeats: int) -> dict:
    import contextlib
    row: dict = {"case": name}
    variants = _variants(model, memsave_model)
    for key, (variant_model, context) in variants.items():
        with (context() if context else contextlib.nullcontext()):
            if context is not None:  # trim decides in its first step; a training loop's later ones are steady
                _held_peak(variant_model, args, kwargs, loss_fn)
            torch.manual_seed(0)
            held, peak = _held_peak(variant_model, args, kwargs, loss_fn)
            row[f"held_{key}"], row[f"peak_{key}"] = held, peak
            row[f"grads_{key}"] = _grads(variant_model, args)
    # plain twice: whether this GPU's kernels give bit-identical gradients at all
    torch.manual_seed(0)
    _held_peak(model, args, kwargs, loss_fn)
    again = _grads(model, args)
    row["plain_repeatable"] = _same(row["grads_plain"], again)
    row["trim_identical"] = _same(row["grads_plain"], row["grads_trim"])
    row["trim_bytes_identical"] = _same(row["grads_plain"], row["grads_trim bytes"])
    if "grads_trim triton" in row:
        row["trim_triton_identical"] = _same(row["grads_plain"], row["grads_trim triton"])
    for key in list(row):
        if key.startswith("grads_"):
            del row[key]
    row.update(_time_variants(variants, args, kwargs, loss_fn, repeats))
    if CUDA:
        for key, (variant_model, context) in variants.items():
            try:
                row[f"gpu_{key}"] = _gpu_profile(variant_model, context, args, kwargs, loss_fn,
                                                 trace=TRACE.get(name) if key == "trim" else None)
            except Exception as error:  # noqa: BLE001
                row[f"gpu_{key}"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                traceback.print_exc(limit=4)
        print("   per steady step: " + "; ".join(
            f"{key}: {g.get('kernels', '?')} kernels, {g.get('changed', '-')} saves changed, GPU busy "
            f"{g.get('busy_ms', float('nan')):.2f} of {g.get('span_ms', float('nan')):.2f} ms, syncs {g.get('syncs', '?')}"
            for key in variants for g in [row[f"gpu_{key}"]]), flush=True)
    held_memsave = "-" if "held_memsave" not in row else f"{row['held_memsave'] / MIB:.1f}"
    peak_memsave = "-" if "peak_memsave" not in row else f"{row['peak_memsave'] / MIB:.1f}"
    print(f"| {name} | {row['held_plain'] / MIB:.1f} | {row['held_trim'] / MIB:.1f} | {held_memsave} | "
          f"{row['peak_plain'] / MIB:.1f} | {row['peak_trim'] / MIB:.1f} | {peak_memsave} | {row['plain_ms']:.1f} | "
          f"{row['trim/plain']:.3f} | {row['held_trim bytes'] / MIB:.1f} | {row['trim bytes/plain']:.3f} | "
          f"{row.get('memsave/plain', float('nan')):.3f} | {row['plain again/plain']:.3f} | "
          f"{row['trim_identical']}, bytes {row['trim_bytes_identical']}, triton {row.get('trim_triton_identical', '-')} "
          f"(plain repeatable: {row['plain_repeatable']}) | {row.get('trim triton/plain', float('nan')):.3f} |",
          flush=True)
    return row


# a torch.profiler trace of the trimmed steady step is written for these cases (name -> file)
TRACE: dict = {}


def _gpu_profile(model, context, args, kwargs, loss_fn, trace=None) -> dict:
    """One variant's steady step on the GPU, read off torch.profiler over 3 steps: device activities
    (kernels, copies, fills) launched per step, the GPU's busy time per step (the union of their
    intervals) and its span (first start to last end: the gaps between are the GPU waiting for the
    host), the saves trim changed per step, and host syncs per step (``set_sync_debug_mode("warn")``
    over one step, nothing synchronised by this script inside it)."""
    import contextlib
    import warnings

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile
    from gradaudit.trimming.handle import handle_of
    steps = 3
    with (context() if context else contextlib.nullcontext()):
        for _ in range(2):
            _step(model, args, kwargs, loss_fn)
        handle = handle_of(model)
        before = dict(handle.stats) if handle is not None else None
        for p in model.parameters():
            p.grad = None
        sync()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss_fn(model(*args, **kwargs)).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        sync()
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        changed = None
        if handle is not None:
            after = handle.stats
            changed = (after["dropped"] - before["dropped"]) + (after["bitpacked"] - before["bitpacked"])
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                _step(model, args, kwargs, loss_fn)
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA)
    busy, last_end = 0.0, None
    for start, end in intervals:
        if last_end is None or start >= last_end:
            busy += end - start
            last_end = end
        elif end > last_end:
            busy += end - last_end
            last_end = end
    # the span per step: the steps are separated by a host sync each, so the span of all three
    # includes the host's time between steps; each step's own span is what the GPU saw of it
    spans = _step_spans(intervals, steps)
    if trace is not None:
        import gzip
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            with open(f"{tmp}/trace.json", "rb") as source, gzip.open(f"{trace}.gz", "wb") as sink:
                sink.write(source.read())
    return {"kernels": len(intervals) / steps, "busy_ms": busy / 1e3 / steps,
            "span_ms": statistics.median(spans) / 1e3 if spans else float("nan"),
            "syncs": syncs, "changed": changed}


def _step_spans(intervals: list, steps: int) -> list:
    """Split the device intervals of ``steps`` steps at the ``steps - 1`` largest gaps between them (the
    host syncs between steps), and give each step's span, microseconds."""
    if len(intervals) < steps:
        return []
    gaps = sorted(range(1, len(intervals)), key=lambda i: intervals[i][0] - intervals[i - 1][1])[-(steps - 1):]
    cuts = [0, *sorted(gaps), len(intervals)]
    return [max(e for _, e in intervals[a:b]) - intervals[a][0] for a, b in zip(cuts, cuts[1:]) if b > a]


def trim_section(out: Path, budget: Budget, repeats: int, small: bool = False) -> None:
    import torchvision
    from gradaudit.scenarios import SCENARIOS, apply_scenario
    try:
        from memsave_torch.nn import convert_to_memory_saving
    except ImportError:
        convert_to_memory_saving = None
    rows = []
    if CUDA:
        TRACE["ResNet-50 32x224 input-only-bn-eval"] = out / "trace_resnet50_bn_eval.json"
        TRACE["Llama 8x1024 bf16 4x1024 probe layer 4"] = out / "trace_llama_probe.json"
    print("| case | held MiB plain | trim | memsave | peak MiB plain | trim | memsave | plain step ms | "
          "trim/plain | held MiB trim bytes | trim bytes/plain | memsave/plain | plain again/plain "
          "| trim grads bit-identical | trim triton/plain |", flush=True)
    for scenario in SCENARIOS:
        if budget.left() < 0:
            break
        if not wanted(f"ResNet-50 32x224 {scenario}"):
            continue
        try:
            fresh()
            torch.manual_seed(0)
            model = torchvision.models.resnet50(num_classes=1000).to(DEVICE)
            x = torch.randn(2, 3, 64, 64, device=DEVICE) if small else torch.randn(32, 3, 224, 224, device=DEVICE)
            apply_scenario(model, scenario, x)
            memsave_model = None
            if convert_to_memory_saving is not None:
                memsave_model = convert_to_memory_saving(model)
                apply_scenario(memsave_model, scenario, x)
            rows.append(_trim_case(f"ResNet-50 32x224 {scenario}", model, memsave_model, (x,), {},
                                   lambda o: o.sum(), repeats))
            del model, memsave_model, x
        except Exception as error:  # noqa: BLE001
            rows.append({"case": f"ResNet-50 {scenario}", "error": f"{type(error).__name__}: {str(error)[:300]}"})
            traceback.print_exc(limit=4)
        write(out, "trim", rows)
    for setting in ("probe layer 4", "norm-only", "LoRA q,v r16"):
        if budget.left() < 0:
            break
        if not wanted(f"Llama 8x1024 bf16 4x1024 {setting}"):
            continue
        try:
            fresh()
            model = _hf("LlamaForCausalLM", torch.bfloat16, **LLAMA)(DEVICE)
            if setting == "LoRA q,v r16":
                model = _lora(lambda device: model)(DEVICE)
            else:
                model.requires_grad_(False)
                for name, module in model.named_modules():
                    if setting == "probe layer 4" and name.endswith("layers.4"):
                        module.requires_grad_(True)
                    if setting == "norm-only" and "norm" in type(module).__name__.lower():
                        module.requires_grad_(True)
            batch = _text_batch(32000, 2 if small else 4, 64 if small else 1024)(DEVICE)
            rows.append(_trim_case(f"Llama 8x1024 bf16 4x1024 {setting}", model, None, (), batch,
                                   lambda o: o.loss, repeats))
            del model
        except Exception as error:  # noqa: BLE001
            rows.append({"case": f"Llama {setting}", "error": f"{type(error).__name__}: {str(error)[:300]}"})
            traceback.print_exc(limit=4)
        write(out, "trim", rows)
    # a BERT whose dropouts are stock modules (on the GPU: native_dropout, whose node keeps a bool mask)
    if budget.left() > 0 and wanted("BERT 6x768 fp32 32x128 dropout, embeddings frozen"):
        try:
            fresh()
            model = _hf("BertForSequenceClassification", torch.float32, num_hidden_layers=6, hidden_act="relu")(DEVICE)
            model.bert.embeddings.requires_grad_(False)
            batch = _text_batch(30522, 2 if small else 32, 64 if small else 128)(DEVICE)
            batch["labels"] = torch.zeros(batch["input_ids"].shape[0], dtype=torch.long, device=DEVICE)
            rows.append(_trim_case("BERT 6x768 fp32 32x128 dropout, embeddings frozen", model, None, (), batch,
                                   lambda o: o.loss, repeats))
            del model
        except Exception as error:  # noqa: BLE001
            rows.append({"case": "BERT dropout", "error": f"{type(error).__name__}: {str(error)[:300]}"})
            traceback.print_exc(limit=4)
        write(out, "trim", rows)
    # the audit's own cost on the GPU (per-op host work that a CPU forward hides)
    if budget.left() > 0 and not small and wanted("audit time"):
        fresh()
        model = torchvision.models.resnet50(num_classes=1000).to(DEVICE).train()
        x = torch.randn(32, 3, 224, 224, device=DEVICE)
        forward = []
        for _ in range(5):
            sync(); t0 = time.perf_counter(); model(x); sync(); forward.append(time.perf_counter() - t0)  # noqa: E702
        audits = []
        for _ in range(3):
            t0 = time.perf_counter(); gradaudit.audit(model, x); sync(); audits.append(time.perf_counter() - t0)  # noqa: E702
        rows.append({"case": "audit time, ResNet-50 32x224 train", "forward_ms": 1e3 * statistics.median(forward),
                     "audit_ms": 1e3 * statistics.median(audits)})
        print(rows[-1], flush=True)
        write(out, "trim", rows)


# ----------------------------------------------------------------------------------------------- gaps

def _requested() -> int:
    return torch.cuda.memory_stats().get("requested_bytes.all.current", 0) if CUDA else 0


def _storage_bytes(tensors) -> int:
    """Unique storages, each rounded up to the caching allocator's 512 bytes."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += -(-t.untyped_storage().nbytes() // 512) * 512
    return total


class _PerCallWorkspace(torch.utils._python_dispatch.TorchDispatchMode):
    """The transient bytes an op allocates and frees within its call (cuDNN's convolution workspaces):
    the peak during the call minus what is allocated after it."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names, self.calls = names, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if not any(n in name for n in self.names):
            return func(*args, **(kwargs or {}))
        sync()
        reset_peak()
        before = allocated()
        out = func(*args, **(kwargs or {}))
        sync()
        self.calls.append((name, peak_allocated() - allocated(), before))
        return out


def gaps(out: Path, budget: Budget) -> None:
    """What the allocator counts beyond the tensors: per model, right after building it and at the
    start of a steady-state step; and cuDNN's per-call convolution workspaces."""
    rows = []
    for name, build, make_batch, optimizer_name, loss_kind in FIT_CASES:
        if budget.left() < 0:
            break
        row: dict = {"case": name}
        try:
            fresh()
            base, base_requested = allocated(), _requested()
            model = build(DEVICE)
            sync()
            row["built_allocated"] = allocated() - base
            row["built_requested"] = _requested() - base_requested
            row["built_storages"] = _storage_bytes([*model.parameters(), *model.buffers()])
            fresh()
            row["after_empty_cache_allocated"] = allocated() - base
            del model
            fresh()
            # the same model built on the CPU in its dtype and moved: one allocation per storage
            cpu_model = build("cpu")
            base = allocated()
            model = cpu_model.to(DEVICE)
            sync()
            row["moved_allocated"] = allocated() - base
            row["moved_storages"] = _storage_bytes([*model.parameters(), *model.buffers()])
            del model, cpu_model
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        print(row, flush=True)
        rows.append(row)
        write(out, "gaps", rows)
    import torchvision
    for label, factory, size, batch in (("ResNet-18", "resnet18", 224, 32), ("ResNet-50", "resnet50", 224, 32),
                                        ("ViT-B/16", "vit_b_16", 224, 16)):
        if budget.left() < 0:
            break
        fresh()
        model = getattr(torchvision.models, factory)(num_classes=1000).to(DEVICE).train()
        x = torch.randn(batch, 3, size, size, device=DEVICE)
        model(x).sum().backward()  # warm-up: cuDNN's plans chosen
        mode = _PerCallWorkspace(("convolution", "cudnn"))
        with mode:
            model(x).sum().backward()
        by_op = collections.defaultdict(list)
        for op, transient, _ in mode.calls:
            by_op[op].append(transient)
        row = {"case": f"{label} {batch}x{size} conv workspaces",
               "by_op": {op: {"calls": len(v), "max": max(v), "sum": sum(v), "distinct": sorted(set(v))[-8:]}
                         for op, v in by_op.items()}}
        print(row, flush=True)
        rows.append(row)
        write(out, "gaps", rows)
    # SegFormer: a Linear on a flattened, transposed feature map (the 2.11 GPU made AddmmBackward0)
    try:
        import transformers
        for dtype in (torch.float32, torch.bfloat16):
            def segformer(device):
                torch.manual_seed(0)
                config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                                      hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                                                      decoder_hidden_size=32, num_labels=3)
                with torch.device(device):
                    return transformers.SegformerForSemanticSegmentation(config).to(dtype).train()
            pixels = torch.randn(2, 3, 64, 64).to(dtype)
            labels = torch.randint(0, 3, (2, 64, 64))
            on_gpu = _figures(gradaudit.audit(segformer(DEVICE), {"pixel_values": pixels.to(DEVICE),
                                                                   "labels": labels.to(DEVICE)}))
            on_meta = _figures(gradaudit.audit(segformer("meta"), {"pixel_values": pixels, "labels": labels},
                                               target="cuda"))
            row = {"case": f"SegFormer {dtype}", "saved_gpu": on_gpu["saved"], "saved_meta": on_meta["saved"],
                   "equal": all(on_gpu[k] == on_meta[k] for k in on_gpu),
                   "only_gpu": sorted((on_gpu["tensors"] - on_meta["tensors"]).items()),
                   "only_meta": sorted((on_meta["tensors"] - on_gpu["tensors"]).items())}
            print(row, flush=True)
            rows.append(row)
    except Exception as error:  # noqa: BLE001
        rows.append({"case": "SegFormer", "error": f"{type(error).__name__}: {str(error)[:300]}"})
        traceback.print_exc(limit=4)
    write(out, "gaps", rows)


# -------------------------------------------------------------------------------------------- profile

def profile(out: Path, budget: Budget) -> None:
    """Where trim's time goes on a fast step: cProfile of trimmed steps, ResNet-50 and the Llama."""
    import cProfile
    import io
    import pstats

    import torchvision
    from gradaudit.scenarios import apply_scenario
    from gradaudit.trimming import trim
    texts = {}
    cases = [("ResNet-50 input-only-bn-eval", None), ("Llama probe layer 4", None)]
    for label, _ in cases:
        fresh()
        if label.startswith("ResNet"):
            model = torchvision.models.resnet50(num_classes=1000).to(DEVICE)
            x = torch.randn(32, 3, 224, 224, device=DEVICE)
            apply_scenario(model, "input-only-bn-eval", x)
            args, kwargs, loss_fn = (x,), {}, (lambda o: o.sum())
        else:
            model = _hf("LlamaForCausalLM", torch.bfloat16, **LLAMA)(DEVICE)
            model.requires_grad_(False)
            model.model.layers[4].requires_grad_(True)
            args, kwargs, loss_fn = (), _text_batch(32000, 4, 1024)(DEVICE), (lambda o: o.loss)
        with trim(model):
            for _ in range(2):
                _step(model, args, kwargs, loss_fn)
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(5):
                _step(model, args, kwargs, loss_fn)
            profiler.disable()
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(30)
        texts[label] = stream.getvalue()
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(30)
        texts[label + " (cumulative)"] = stream.getvalue()
        print(label, texts[label][:6000], flush=True)
        del model
    (out / "profile.txt").write_text("\n\n".join(f"== {k}\n{v}" for k, v in texts.items()))


# ---------------------------------------------------------------------------------------- determinism

def determinism(out: Path, budget: Budget) -> None:
    """Trimmed gradients against plain ones with deterministic kernels (CUBLAS_WORKSPACE_CONFIG must
    be set before CUDA starts): plain twice must agree, then trimmed must equal plain."""
    import torchvision
    from gradaudit.scenarios import SCENARIOS, apply_scenario
    from gradaudit.trimming import trim
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    rows = []
    for scenario in SCENARIOS:
        fresh()
        torch.manual_seed(0)
        model = torchvision.models.resnet50(num_classes=1000).to(DEVICE)
        x = torch.randn(8, 3, 224, 224, device=DEVICE)
        apply_scenario(model, scenario, x)
        results = []
        for trimmed in (False, False, True):
            torch.manual_seed(0)
            for t in [*model.parameters(), x]:
                t.grad = None
            if trimmed:
                with trim(model):
                    model(x).sum().backward()
            else:
                model(x).sum().backward()
            results.append(_grads(model, (x,)))
        rows.append({"case": f"ResNet-50 8x224 {scenario}", "plain_repeatable": _same(results[0], results[1]),
                     "trim_identical": _same(results[0], results[2])})
        print(rows[-1], flush=True)
    for setting in ("probe layer 4", "LoRA q,v r16"):
        fresh()
        model = _hf("LlamaForCausalLM", torch.bfloat16, **LLAMA)(DEVICE)
        if setting.startswith("LoRA"):
            model = _lora(lambda device: model)(DEVICE)
        else:
            model.requires_grad_(False)
            model.model.layers[4].requires_grad_(True)
        batch = _text_batch(32000, 4, 1024)(DEVICE)
        results = []
        for trimmed in (False, False, True):
            torch.manual_seed(0)
            for p in model.parameters():
                p.grad = None
            if trimmed:
                with trim(model):
                    model(**batch).loss.backward()
            else:
                model(**batch).loss.backward()
            results.append(_grads(model, ()))
        rows.append({"case": f"Llama bf16 4x1024 {setting}", "plain_repeatable": _same(results[0], results[1]),
                     "trim_identical": _same(results[0], results[2])})
        print(rows[-1], flush=True)
        del model
    write(out, "determinism", rows)


# -------------------------------------------------------------------------------------------- fitcuda

def fitcuda(out: Path, budget: Budget) -> None:
    """``fit`` of a model on the GPU itself (its step followed there, backward on autograd's device
    thread) against ``fit`` of the same model on meta for CUDA, and the time each took."""
    rows = []
    for name, build, make_batch, optimizer_name, loss_kind in FIT_CASES:
        if budget.left() < 0:
            break
        row: dict = {"case": name}
        try:
            loss_fn = _loss(loss_kind)
            on_meta, row["meta_s"] = _fit_on_meta(build, make_batch, optimizer_name, loss_fn)
            fresh()
            model = build("cpu").to(DEVICE)
            t0 = time.perf_counter()
            on_gpu = gradaudit.fit(model, make_batch(DEVICE), memory="80GiB", optimizer=optimizer_name, loss=loss_fn,
                                   remedy=False)
            row["gpu_s"] = time.perf_counter() - t0
            row.update(meta_peak=on_meta.peak_bytes, gpu_peak=on_gpu.peak_bytes, meta=dict(on_meta.breakdown),
                       gpu=dict(on_gpu.breakdown), equal=on_meta.peak_bytes == on_gpu.peak_bytes,
                       notes=on_gpu.notes[:4])
            del model
            print(f"| {name} | {on_meta.peak_bytes:,} | {on_gpu.peak_bytes:,} | {row['equal']} | "
                  f"{row['meta_s']:.1f} s | {row['gpu_s']:.1f} s |", flush=True)
            if not row["equal"]:
                print("   meta", row["meta"], "\n   gpu ", row["gpu"], flush=True)
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            print(f"| {name} | error: {row['error']} |", flush=True)
            traceback.print_exc(limit=6)
        rows.append(row)
        write(out, "fitcuda", rows)


# ---------------------------------------------------------------------------------------------- codec

def _time_op(fn, reps: int = 20) -> tuple[float, float]:
    """(GPU ms per call by CUDA events, host us per call with no sync inside), medians."""
    fn()
    sync()
    host, device = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end))
    return statistics.median(device), 1e6 * statistics.median(host)


def codec_section(out: Path, budget: Budget) -> None:
    """Ways to pack a ReLU result's bits and unpack them on the GPU, side by side at ResNet-50's
    activation sizes: GPU time per call and host time per call (the launch cost a step pays)."""
    from gradaudit.trimming import codec, fused

    class Box:
        pass

    rows = []
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=DEVICE)
    zero, one = torch.zeros((), device=DEVICE), torch.ones((), device=DEVICE)
    for shape, dtype in [((32, 64, 112, 112), torch.float32), ((32, 256, 56, 56), torch.float32),
                         ((32, 2048, 7, 7), torch.float32), ((32, 256, 56, 56), torch.bfloat16),
                         ((4, 1024, 2816), torch.bfloat16)]:
        if budget.left() < 0:
            break
        x = torch.randn(shape, device=DEVICE, dtype=dtype).relu_().view(-1)
        mask = x <= 0
        packed = codec._pack_bits_with_torch(mask)
        box = Box()
        box.payload, box.scale, box.dtype = packed, -1.0, dtype
        # a ReLU's result as trim keeps it now (Bit.NE_ZERO): x != 0, its bits standing for 1.0
        passes = x.bool()
        packed_ne = codec._pack_bits_with_torch(passes)
        box_ne = Box()
        box_ne.payload, box_ne.scale, box_ne.dtype = packed_ne, 1.0, dtype
        table = codec._bit_table(-1.0, dtype, packed.device)
        zero_, one_ = zero.to(dtype), one.to(dtype)
        variants = {
            "pack: compare (bytes before)": lambda: x <= 0,
            "pack: to bool, x != 0 (bytes now)": lambda: x.bool(),
            "pack: compare, mul, sum (oldest)": lambda: torch.sum((x <= 0).view(-1, 8).view(torch.uint8) * weights,
                                                                  dim=1, dtype=torch.uint8),
            "pack: compare, word mul, copy (before)": lambda: codec._pack_bits_with_torch(x <= 0),
            "pack: to bool, word mul_, copy (x != 0, now)": lambda: codec._pack_bits_with_torch(x.bool(), scratch=True),
            "unpack: where from bytes (before)": lambda: torch.where(mask, zero_, one_),
            "unpack: to dtype from bytes (now)": lambda: passes.to(dtype),
            "unpack: int, index_select (oldest)": lambda: torch.index_select(table, 0, packed.int()),
            "unpack: long, index (table[idx])": lambda: table[packed.long()],
            "unpack: shift, and, where (before; threshold now)": lambda: codec._unpack_with_torch(box),
            "unpack: shift, and, to (x != 0, now)": lambda: codec._unpack_with_torch(box_ne),
        }
        if fused.installed() and fused.takes(x):
            variants["pack: triton fused"] = lambda: fused.pack(x, fused.LE_ZERO)
            variants["unpack: triton fused"] = lambda: fused.unpack(packed, x.numel(), -1.0, dtype)
        expected = torch.where(mask, zero_, one_)
        row: dict = {"shape": list(shape), "dtype": str(dtype)[6:], "elements": x.numel()}
        for name, fn in variants.items():
            try:
                result = fn()
                if name.startswith("unpack"):
                    row[f"{name} exact"] = bool(torch.equal(result.reshape(-1)[:x.numel()], expected))
                elif "sum" in name or "copy" in name or "triton" in name:
                    row[f"{name} exact"] = bool(torch.equal(result, packed_ne if "x != 0" in name else packed))
                del result
                row[name] = _time_op(fn)
            except Exception as error:  # noqa: BLE001
                row[name] = f"{type(error).__name__}: {str(error)[:200]}"
        rows.append(row)
        print(f"{tuple(shape)} {row['dtype']}:", flush=True)
        for name in variants:
            value = row[name]
            text = f"GPU {value[0] * 1e3:8.1f} us, host {value[1]:6.1f} us" if isinstance(value, tuple) else value
            print(f"   {name:40s} {text}  exact: {row.get(name + ' exact', '-')}", flush=True)
        write(out, "codec", rows)
        del x, mask, packed, passes, packed_ne
    # a bool keep-mask (native_dropout's, GA403: every CUDA nn.Dropout in training) to bits and back, as
    # trim does by default: what it costs per mask against the 7/8 of the mask it frees (a BERT-base
    # attention-probability mask at 32 x 128 tokens, and a hidden-state one)
    for shape in [(32, 12, 128, 128), (32, 128, 768)]:
        if budget.left() < 0:
            break
        flat = (torch.rand(shape, device=DEVICE) >= 0.1).view(-1)
        packed = codec._pack_bits_with_torch(flat)
        box = Box()
        box.payload, box.scale, box.dtype = packed, 1.0, torch.bool
        row = {"shape": list(shape), "dtype": "bool", "elements": flat.numel(),
               "bool mask: unpack bits exact": bool(torch.equal(
                   codec._unpack_with_torch(box).reshape(-1)[:flat.numel()], flat))}
        variants = {"bool mask: pack bits": lambda: codec._pack_bits_with_torch(flat),
                    "bool mask: unpack bits": lambda: codec._unpack_with_torch(box)}
        for name, fn in variants.items():
            try:
                row[name] = _time_op(fn)
            except Exception as error:  # noqa: BLE001
                row[name] = f"{type(error).__name__}: {str(error)[:200]}"
        rows.append(row)
        print(f"{tuple(shape)} bool:", {k: v for k, v in row.items() if k.startswith("bool")}, flush=True)
        write(out, "codec", rows)
        del flat, packed
    # what a saved tensor's register_hooks and a module forward hook cost on this host
    lin = torch.nn.Linear(64, 64, device=DEVICE).requires_grad_(False)
    inp = torch.randn(8, 64, device=DEVICE, requires_grad=True)
    nodes = [(inp * 2).sin() for _ in range(200)]
    t0 = time.perf_counter()
    for y in nodes:
        y.grad_fn._raw_saved_self.register_hooks(lambda t: None, lambda v: None)
    per_hook = (time.perf_counter() - t0) / len(nodes) * 1e6
    handle = lin.register_forward_hook(lambda m, a, o: None)
    plain_calls, hooked_calls = [], []
    for _ in range(5):
        handle.remove()
        t0 = time.perf_counter()
        for _ in range(200):
            lin(inp)
        plain_calls.append(time.perf_counter() - t0)
        handle = lin.register_forward_hook(lambda m, a, o: None)
        t0 = time.perf_counter()
        for _ in range(200):
            lin(inp)
        hooked_calls.append(time.perf_counter() - t0)
    handle.remove()
    sync()
    host = {"register_hooks_us": per_hook,
            "linear_call_us": statistics.median(plain_calls) / 200 * 1e6,
            "forward_hook_added_us": (statistics.median(hooked_calls) - statistics.median(plain_calls)) / 200 * 1e6}
    rows.append(host)
    print(host, flush=True)
    write(out, "codec", rows)


# ------------------------------------------------------------------------------------------- compiled

def _compiled_held(loss, model, inputs) -> tuple[int, int, int]:
    """(compiled regions, bytes of the storages their nodes keep beside the parameters, buffers and
    inputs, bytes every node of the graph keeps beside them), read off a plain run's graph: the
    independent count."""
    alive = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *inputs]}
    regions, compiled_storages, all_storages, stack, seen = 0, {}, {}, [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        is_region = type(node).__name__ == "CompiledFunctionBackward"
        regions += is_region
        saved = list(node.saved_tensors) if is_region else []
        if not is_region:
            for name in dir(node):
                if name.startswith("_saved_"):
                    try:
                        value = getattr(node, name)
                    except Exception:  # noqa: BLE001
                        continue
                    saved.extend(v for v in (value if isinstance(value, (tuple, list)) else [value]))
        for t in saved:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in alive:
                key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                all_storages[key] = size
                if is_region:
                    compiled_storages[key] = size
        stack.extend(next_node for next_node, _ in node.next_functions)
    return regions, sum(compiled_storages.values()), sum(all_storages.values())


def _compiled_resnet(device: str):
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).requires_grad_(False).eval()
    model.layer1.requires_grad_(True)
    model.fc.requires_grad_(True)
    return model.to(device)


def _compiled_gpt2(device: str):
    model = _hf("GPT2LMHeadModel", torch.float32, n_layer=4, n_embd=256, n_head=4, vocab_size=1000, bos_token_id=0,
                eos_token_id=0)(device)
    model.transformer.wte.requires_grad_(False)
    return model


def _compiled_case(name: str, build, make_inputs, backend: str, loss_fn) -> dict:
    """A compiled model on the GPU as its user runs it (regions, held bytes counted off the graph, the
    allocator's rise over the forward) against gradaudit's audit of it, with every save's record; and
    the audit of the same model on meta for CUDA (what it gives today)."""
    import warnings
    row: dict = {"case": name, "backend": backend}
    torch._dynamo.reset()
    fresh()
    model = build(DEVICE)
    args, kwargs = make_inputs(DEVICE)
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        loss_fn(compiled(*args, **kwargs)).backward()  # the compile
        row["compile_s"] = time.perf_counter() - t0
        for p in model.parameters():
            p.grad = None
        sync()
        base = allocated()
        loss = loss_fn(compiled(*args, **kwargs))
        sync()
        row["allocator_rise"] = allocated() - base
        tensors = [*args, *[v for v in kwargs.values() if isinstance(v, torch.Tensor)]]
        row["regions"], row["compiled_held"], row["graph_held"] = _compiled_held(loss, model, tensors)
        del loss
        t0 = time.perf_counter()
        inputs = kwargs if kwargs else (args[0] if len(args) == 1 else args)
        report = gradaudit.audit(compiled, inputs)
        row["audit_s"] = time.perf_counter() - t0
        saves = [t for t in report.tensors if t.node == "CompiledFunctionBackward"]
        row.update(audit_saved=report.saved_bytes, audit_regions=sum(n.name == "CompiledFunctionBackward"
                                                                          for n in report.nodes),
                   audit_compiled_bytes=_bytes_by_kind(report, saves),
                   on_root=sum(t.module == "" for t in saves), saves=len(saves),
                   findings=[(f.code, f.module, f.bytes) for f in report.findings],
                   tensors=[(t.attr, list(t.shape), str(t.dtype), report.storages[t.storage_id].nbytes
                             if t.storage_id >= 0 else None, str(t.storage_kind), t.module, str(t.verdict),
                             getattr(t, "copy_of", None), t.reason[:160]) for t in saves])
        if backend == "aot_eager" or budget_ok():
            t0 = time.perf_counter()
            verified = gradaudit.audit(compiled, inputs, verify=True)
            row["verify_s"] = time.perf_counter() - t0
            row["verified"] = collections.Counter(f"{t.verdict}{' proven' if t.proven else ''}"
                                                  for t in verified.tensors if t.node == "CompiledFunctionBackward")
            row["verified_findings"] = [(f.code, f.module, f.bytes) for f in verified.findings]
    del compiled, model
    torch._dynamo.reset()
    try:
        meta_model = build("meta")
        meta_args, meta_kwargs = make_inputs("meta")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            on_meta = gradaudit.audit(torch.compile(meta_model, backend=backend),
                                      meta_kwargs if meta_kwargs else meta_args[0], target="cuda")
        row["meta_cuda"] = {"saved": on_meta.saved_bytes,
                            "nodes": collections.Counter(t.node for t in on_meta.tensors)}
    except Exception as error:  # noqa: BLE001
        row["meta_cuda"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    torch._dynamo.reset()
    return row


def _bytes_by_kind(report, saves) -> dict:
    """Bytes of the distinct storages of ``saves``, per storage kind."""
    kinds: dict = {}
    for sid in {t.storage_id for t in saves if t.storage_id >= 0}:
        kind = str(next(t.storage_kind for t in saves if t.storage_id == sid))
        kinds[kind] = kinds.get(kind, 0) + report.storages[sid].nbytes
    return kinds


_COMPILED_BUDGET = [None]


def budget_ok() -> bool:
    return _COMPILED_BUDGET[0] is None or _COMPILED_BUDGET[0].left() > 60


def compiled_section(out: Path, budget: Budget) -> None:
    """Compiled models on the GPU (issue 44's reference figures for a later meta-as-CUDA emulation)."""
    _COMPILED_BUDGET[0] = budget

    def pixels(batch: int, size: int):
        def make(device: str):
            x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))
            return (x.to(device) if device != "meta" else x.to("meta"),), {}
        return make

    def text(device: str):
        return (), _text_batch(1000, 4, 128)(device)

    cases = [("ResNet-18 2x64 layer1+fc trained, rest eval", _compiled_resnet, pixels(2, 64), "aot_eager",
              lambda o: o.sum()),
             ("ResNet-18 2x64 layer1+fc trained, rest eval", _compiled_resnet, pixels(2, 64), "inductor",
              lambda o: o.sum()),
             ("ResNet-18 32x224 layer1+fc trained, rest eval", _compiled_resnet, pixels(32, 224), "inductor",
              lambda o: o.sum()),
             ("GPT-2 4x256 fp32 4x128 padded, labels, embeddings frozen", _compiled_gpt2, text, "inductor",
              lambda o: o.loss)]
    rows = []
    if wanted("eager verify"):
        # the proof on the GPU's own kernels: an eager ResNet-18 as above, its verdicts proven
        fresh()
        model = _compiled_resnet(DEVICE)
        x = torch.randn(2, 3, 64, 64, device=DEVICE)
        report = gradaudit.audit(model, x, verify=True)
        rows.append({"case": "eager verify, ResNet-18 2x64 layer1+fc trained, rest eval",
                     "verified": collections.Counter(f"{t.verdict}{' proven' if t.proven else ''}" for t in report.tensors),
                     "unproven": collections.Counter(t.unproven[:60] for t in report.tensors if t.unproven),
                     "disagreements": [(d.node, d.attr, d.static, d.proven) for d in report.disagreements],
                     "reclaimable": report.reclaimable_bytes, "findings": len(report.findings)})
        print(rows[-1], flush=True)
        write(out, "compiled", rows)
        del model, x
    for name, build, make_inputs, backend, loss_fn in cases:
        if budget.left() < 45:
            break
        if not wanted(f"{name} {backend}"):
            continue
        try:
            row = _compiled_case(name, build, make_inputs, backend, loss_fn)
        except Exception as error:  # noqa: BLE001
            row = {"case": name, "backend": backend, "error": f"{type(error).__name__}: {str(error)[:400]}"}
            traceback.print_exc(limit=6)
        rows.append(row)
        print({k: v for k, v in row.items() if k != "tensors"}, flush=True)
        write(out, "compiled", rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all sections; each stops when spent")
    parser.add_argument("--sections", default="facts,zoo,fit,trim")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--small", action="store_true", help="trim on small inputs (a smoke test on the CPU)")
    parser.add_argument("--cases", default="", help="comma-separated substrings: only the trim and compiled cases "
                        "whose names hold one")
    parser.add_argument("--zoo-share", type=float, default=0.3, help="share of the budget the zoo may take")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    CASES.extend(part for part in args.cases.split(",") if part)
    sections = args.sections.split(",")
    unknown = set(sections) - {"facts", "zoo", "fit", "trim", "gaps", "profile", "determinism", "fitcuda", "compiled", "codec"}
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    start = time.monotonic()
    total = Budget(args.budget)
    for section in sections:
        print(f"\n== {section} ({time.monotonic() - start:.0f} s in)", flush=True)
        share = Budget(min(total.left(), args.budget * args.zoo_share)) if section == "zoo" else total
        try:
            if section == "facts":
                facts(args.out, share)
            elif section == "zoo":
                zoo(args.out, share)
            elif section == "fit":
                fit(args.out, share)
            elif section in ("gaps", "profile", "determinism", "fitcuda"):
                globals()[section](args.out, share)
            elif section == "compiled":
                compiled_section(args.out, share)
            elif section == "codec":
                codec_section(args.out, share)
            else:
                trim_section(args.out, share, args.repeats, args.small)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    print(f"\ndone in {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
