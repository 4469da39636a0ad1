"""What gradaudit.trim costs the host per training step, and what it frees: the steady plan against
trim deciding every forward fully (how trim ran before the steady plan, and how its first forward
runs now).

On the meta device no kernel runs, so a step's time there is its host side alone: the dispatch and
Python work a GPU step waits on when the host is the bottleneck. Per case, at GPU shapes on meta:
- host time per forward+backward (thread CPU time; the fastest of interleaved rounds): plain, trim
  deciding fully every forward ("full"), trim's steady plan ("steady"), and that with
  ``masks="bytes"`` ("bytes"); the ms trim adds; and a second plain column against the first, the
  noise floor;
- the time spent inside trim per steady step, timed around each of its callbacks (the steady plan's
  module hooks with the packing they run, the unpack hooks, the root's begin and end), plus what
  nn.Module's hook path adds to each hooked module call (measured apart): steadier than the step
  time differences on a shared machine, which move by more than trim adds; beside it the API's floor
  (``api_floor``): the same saves given pack and unpack hooks that do nothing, from hooks on the same
  modules, what any design handing each changed save hooks of its own pays (bytes are trim's default
  on a GPU, bits on the CPU);
- aten ops dispatched per step (a TorchDispatchMode count): added by each, and by steady per save
  it changed (dropped + bit-packed) and in all; and of those, kernels per changed save: ops that are
  neither views (autograd's detach around a save with hooks, reshapes) nor allocations, the ones that
  launch a kernel and pass over memory on a GPU;
- host syncs per step (``_local_scalar_dense``, ``is_nonzero``, ``equal``, ``nonzero``, ``item``);
- on the CPU, at small shapes: held and peak bytes (``gradaudit.trimming.compare``: the trimmed
  figures are the steady forward's) against trim deciding fully, and (the ResNet-50 rows) with
  ``masks="bytes"`` and against memsave_torch's converted model measured the same way
  (``gradaudit.measure.forward_backward``), where its source lies in ``.dev/memsave`` (it is not on
  PyPI: ``git clone https://github.com/plutonium-239/memsave_torch .dev/memsave``; ignored by git);
  gradients of a steady step bit-identical to a plain one's with bits and with bytes, and the
  time inside trim per steady step again (there an op costs a dispatch and a small kernel, nearer a
  GPU launch's host cost than meta's 30-40 us of Python meta kernel; the CPU's own codec paths run:
  bits unpacked by a table lookup, bytes by a conversion).

    python benchmarks/bench_trim_host.py                  # every case, about 5 minutes on 2 cores
    python benchmarks/bench_trim_host.py --cases resnet50-input-only llama-probe --rounds 5

Goals (issue 41): ResNet-50 <= 1.0 ms added per step in every scenario, the Llama <= 0.3 ms, 0 syncs,
<= 2 ops added per changed save, held and peak no worse than full decisions by more than 2%.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradaudit.measure import forward_backward
from gradaudit.scenarios import SCENARIOS, apply_scenario
from gradaudit.tensors import iter_tensors
from gradaudit.trimming import compare, trim

# memsave_torch from its source, where a developer put it (benchmarks/gpu_check.py looks there too)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / ".dev" / "memsave"))

_SYNCS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "item"}


# ops that launch no kernel on a GPU besides views (``is_view``: detach, view, as_strided, ...):
# allocations, which the caching allocator serves on the host
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "empty_permuted", "new_empty", "new_empty_strided"}


class OpCount(TorchDispatchMode):
    """aten ops dispatched, those of them that run a kernel (not a view, not an allocation), and
    host syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.kernels = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.__name__.split(".")[0]
        if not func.is_view and name not in _NO_KERNEL:
            self.kernels += 1
        if name in _SYNCS:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


# -- cases: (build on a device) -> (model, args, kwargs, loss of the output) -------------------------

def _resnet(scenario: str, batch: int, size: int, device: str) -> tuple:
    import torchvision
    with torch.device(device):
        model = torchvision.models.resnet50(num_classes=1000)
        x = torch.randn(batch, 3, size, size)
    apply_scenario(model, scenario, x)
    return model, (x,), {}, lambda out: out.float().sum()


def _values_unread(device: str) -> None:
    """On meta, Hugging Face's mask helpers would read values (``.all()`` of a padding mask, packed
    sequences in the position ids): they skip those reads for traced tensors, so every tensor is
    said to be traced (the same for plain and trimmed steps; the masks are built as given)."""
    if device == "meta":
        from transformers import masking_utils
        masking_utils.is_tracing = lambda *args, **kwargs: True


def _llama(lora: bool, batch: int, sequence: int, device: str) -> tuple:
    from transformers import LlamaConfig, LlamaForCausalLM
    _values_unread(device)
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                         use_cache=False, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        ids = torch.randint(0, 32000, (batch, sequence)) if device != "meta" else \
            torch.zeros((batch, sequence), dtype=torch.long)
    model.requires_grad_(False)
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    else:
        model.model.layers[4].requires_grad_(True)  # the probe: one block trains
    model.train()
    return model, (), {"input_ids": ids, "labels": ids}, lambda out: out.loss


def _bert(batch: int, sequence: int, device: str) -> tuple:
    from transformers import BertConfig, BertForSequenceClassification
    _values_unread(device)
    config = BertConfig(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072,
                        hidden_act="relu", attn_implementation="eager")
    with torch.device(device):
        model = BertForSequenceClassification(config).train()
        ids = torch.zeros((batch, sequence), dtype=torch.long)
        labels = torch.zeros((batch,), dtype=torch.long)
        mask = torch.ones((batch, sequence), dtype=torch.long)
    model.bert.embeddings.requires_grad_(False)
    return model, (), {"input_ids": ids, "attention_mask": mask, "labels": labels}, lambda out: out.loss


def cases(device: str, small: bool) -> dict[str, Callable[[], tuple]]:
    b, s = (2, 64) if small else (32, 224)
    found: dict[str, Callable[[], tuple]] = {}
    for scenario in SCENARIOS:
        found[f"resnet50-{scenario}"] = lambda scenario=scenario: _resnet(scenario, b, s, device)
    lb, ls = (1, 32) if small else (4, 1024)
    found["llama-probe"] = lambda: _llama(False, lb, ls, device)
    found["llama-lora"] = lambda: _llama(True, lb, ls, device)
    bb, bs = (2, 32) if small else (32, 128)
    found["bert-dropout"] = lambda: _bert(bb, bs, device)
    return found


# -- measuring --------------------------------------------------------------------------------------

def step(model: nn.Module, args: tuple, kwargs: dict, loss: Callable) -> None:
    for p in model.parameters():
        p.grad = None
    loss(model(*args, **kwargs)).backward()


class Variant:
    """plain, trim deciding fully every forward, trim's steady plan, or that with masks="bytes":
    entered around a step."""

    def __init__(self, model: nn.Module, how: str) -> None:
        self.model, self.how, self.handle = model, how, None

    def __enter__(self) -> None:
        if self.how != "plain":
            self.handle = trim(self.model, masks="bytes" if self.how == "bytes" else "bits")
            if self.how == "full":
                self.handle._engine.can_steady = False  # what trim did before the steady plan

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.remove()


def host_times(model: nn.Module, args: tuple, kwargs: dict, loss: Callable, rounds: int) -> dict[str, float]:
    """Thread CPU seconds per step of plain, full, steady and plain again: the fastest of interleaved
    rounds (the median moved by +-10% between runs here; the minimum by under 1%)."""
    order = ["plain", "full", "steady", "bytes", "plain2"]
    handles = {how: Variant(model, how.rstrip("2")) for how in order}
    times: dict[str, list[float]] = {how: [] for how in order}
    for how in order:
        handles[how].__enter__()
        step(model, args, kwargs, loss)  # warm-up, and for trim the forward that decides
        handles[how].__exit__()
    # a steady trim keeps its plan between rounds: installed once, stepped once first
    for r in range(rounds + 1):
        for how in order:
            with handles[how]:
                if how in ("steady", "bytes"):
                    step(model, args, kwargs, loss)  # decides; the timed step is steady
                gc.collect()
                start = time.thread_time()
                step(model, args, kwargs, loss)
                elapsed = time.thread_time() - start
            if r:
                times[how].append(elapsed)
    # the fastest round of each: on a shared machine, interference only ever adds time
    return {how: min(values) for how, values in times.items()}


def _hook_call_cost(calls: int = 20000) -> float:
    """Seconds a module call costs more with one forward hook that returns at once than with none
    (what nn.Module's hook path adds to each call of a module trim hooks), fastest of 5 rounds."""
    module = nn.Identity()
    x = torch.zeros(())

    def rounds() -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                module(x)
            best = min(best, time.perf_counter() - start)
        return best / calls

    bare = rounds()
    handle = module.register_forward_hook(lambda m, a, o: None)
    try:
        return max(0.0, rounds() - bare)
    finally:
        handle.remove()


def trim_own_time(model: nn.Module, args: tuple, kwargs: dict, loss: Callable, masks: str,
                  rounds: int) -> tuple[float, int]:
    """(seconds spent inside trim per steady step, module calls that ran a hook of trim's): the steady
    plan's hooks (which register the changed saves' hooks and run their packing), the unpack hooks in
    backward, and the root's begin and end, each timed around its call, the fastest of ``rounds``
    steps. What this leaves out is what nn.Module's hook path adds to each hooked call (see
    ``_hook_call_cost``) and autograd's own work for a save with hooks (its detaches)."""

    spent = [0.0]
    calls = [0]

    def timed(fn: Callable, count: bool = False) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - start
                calls[0] += count
        return wrapper

    handle = trim(model, masks=masks)
    try:
        step(model, args, kwargs, loss)  # decides
        engine = handle._engine
        plan = engine.plan
        plan.remove()
        for _, per_call in plan.modules.values():
            for entries in per_call:
                for entry in entries:
                    for slot in entry.slots:
                        slot.unpack = timed(slot.unpack)
        original_post, original_pre = plan._make_post, plan._pre
        plan._make_post = lambda per_call: timed(original_post(per_call), count=True)
        plan._pre = timed(original_pre)
        plan.install()
        engine.begin, engine.end = timed(engine.begin), timed(engine.end)
        best = float("inf")
        for _ in range(rounds):
            spent[0], calls[0] = 0.0, 0
            gc.collect()
            step(model, args, kwargs, loss)
            assert engine.mode is None and plan is engine.plan, "the timed step was not a steady one"
            best = min(best, spent[0])
        return best, calls[0]
    finally:
        handle.remove()


def api_floor(model: nn.Module, args: tuple, kwargs: dict, loss: Callable, rounds: int) -> float:
    """Seconds per steady step that the saves trim's steady plan changes cost through the same torch API
    with nothing of trim's own, timed as ``trim_own_time`` times trim: a forward hook on each module the
    plan hooks, each planned node reached from its module's output by the plan's path, and on each of
    its planned saves a pack hook that returns None and an unpack hook that returns a stand-in made in a
    warm-up step (no check, no conversion, no allocation). The least a design that hands each changed
    save hooks of its own (``SavedTensor.register_hooks``) pays per step; fastest of ``rounds``."""
    handle = trim(model, masks="bytes")
    step(model, args, kwargs, loss)  # decides
    plan = handle._engine.plan
    modules = [(ref(), calls) for ref, calls in plan.modules.values()]
    root = plan.root
    handle.remove()
    spent = [0.0]

    def slot_hooks() -> tuple[Callable, Callable]:
        stand_in: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> None:
            if not stand_in:  # the warm-up step
                stand_in.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device))

        def unpack(_: Any) -> torch.Tensor:
            # timed as trim_own_time times trim's unpack hooks (its two clock reads included); the body
            # itself does nothing
            start = time.perf_counter()
            spent[0] += time.perf_counter() - start
            return stand_in[0]

        return pack, unpack

    def specs_of(entries: list[Any]) -> list[tuple[int, tuple[int, ...], list[tuple[str, int, Any, Any]]]]:
        return [(e.out, e.path, [(slot.attr, slot.item, *slot_hooks()) for slot in e.slots]) for e in entries]

    def register(specs: list[Any], output: Any) -> None:
        tensors = [output] if isinstance(output, torch.Tensor) else [t for t in iter_tensors(output)]
        for out, path, slots in specs:
            if out >= len(tensors):
                continue
            node = tensors[out].grad_fn
            for i in path:
                node = node.next_functions[i][0] if node is not None else None
            if node is None:
                continue
            for attr, item, pack, unpack in slots:
                raw = getattr(node, attr)
                if item >= 0:
                    raw = raw[item]
                raw.register_hooks(pack, unpack)

    def hook_for(per_call: list[Any]) -> Callable:
        count = [0]

        def post(module: nn.Module, inputs: Any, output: Any) -> None:
            start = time.perf_counter()
            index = count[0] % len(per_call)
            count[0] += 1
            register(per_call[index], output)
            spent[0] += time.perf_counter() - start

        return post

    handles = [module.register_forward_hook(hook_for([specs_of(entries) for entries in calls]))
               for module, calls in modules if module is not None]
    if root:
        handles.append(model.register_forward_hook(hook_for([specs_of(root)])))
    try:
        step(model, args, kwargs, loss)  # warm-up: the stand-ins made
        best = float("inf")
        for _ in range(rounds):
            spent[0] = 0.0
            gc.collect()
            step(model, args, kwargs, loss)
            best = min(best, spent[0])
        return best
    finally:
        for h in handles:
            h.remove()


def op_counts(model: nn.Module, args: tuple, kwargs: dict, loss: Callable) -> dict[str, Any]:
    counts: dict[str, Any] = {}
    for how in ("plain", "full", "steady", "bytes"):
        variant = Variant(model, how)
        variant.__enter__()
        try:
            step(model, args, kwargs, loss)
            stats_before = dict(variant.handle.stats) if variant.handle else None
            with OpCount() as counter:
                step(model, args, kwargs, loss)
            counts[how] = (counter.ops, counter.syncs, counter.kernels)
            if how in ("steady", "bytes"):
                after = variant.handle.stats
                counts["changed"] = (after["dropped"] - stats_before["dropped"]) + \
                    (after["bitpacked"] - stats_before["bitpacked"])
                counts["forwards"] = variant.handle.forwards
        finally:
            variant.__exit__()
    return counts


def bytes_and_gradients(build: Callable[[], tuple]) -> tuple[dict[str, int], dict[str, int], bool]:
    """On the CPU: compare() with the steady plan, and with full decisions; gradients of both equal."""
    model, args, kwargs, loss = build()
    inputs = kwargs if kwargs else args
    steady_figures = compare(model, inputs)

    # full decisions every forward: compare() installs its own handle; turn its steady plan off
    import gradaudit.trimming.handle as handle_module
    engine_init = handle_module.Engine.__init__

    def full_only(self, *a: Any, **k: Any) -> None:
        engine_init(self, *a, **k)
        self.can_steady = False

    handle_module.Engine.__init__ = full_only
    try:
        full_figures = compare(model, inputs)
    finally:
        handle_module.Engine.__init__ = engine_init
    # gradients: plain against a steady trimmed step, from the same state and RNG
    state = copy.deepcopy(model.state_dict())

    def grads() -> list:
        torch.manual_seed(0)
        for t in [*model.parameters(), *args]:
            t.grad = None
        step(model, args, kwargs, loss)
        return [p.grad.clone() for p in model.parameters() if p.grad is not None] + \
            [t.grad.clone() for t in args if isinstance(t, torch.Tensor) and t.grad is not None]

    plain = grads()
    same = True
    for masks in ("bits", "bytes"):
        model.load_state_dict(state)
        with trim(model, masks=masks):
            grads()
            model.load_state_dict(state)
            trimmed = grads()
        same = same and len(plain) == len(trimmed) and all(torch.equal(a, b) for a, b in zip(plain, trimmed))
    model.load_state_dict(state)
    return steady_figures, full_figures, same


def bytes_and_memsave(build: Callable[[], tuple]) -> str:
    """On the CPU: held / peak of a steady step with ``masks="bytes"``, and of a plain step of
    memsave_torch's conversion of the same model ("-" where its source is not in .dev/memsave)."""
    model, args, kwargs, loss = build()
    inputs = kwargs if kwargs else args
    figures = compare(model, inputs, masks="bytes")
    text = f"{figures['held_after']:,} / {figures['peak_after']:,}"
    try:
        from memsave_torch.nn import convert_to_memory_saving
    except ImportError:
        return text + ", memsave -"
    converted = convert_to_memory_saving(copy.deepcopy(model))
    held, peak = forward_backward(converted, args, kwargs)
    return text + f", memsave {held:,} / {peak:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = list(cases("meta", False))
    parser.add_argument("--cases", nargs="*", default=names, choices=names)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds of timed steps (fastest)")
    parser.add_argument("--no-bytes", action="store_true", help="skip the CPU columns (held, peak, inside trim)")
    options = parser.parse_args()
    torch.set_num_threads(1)
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}, "
          f"1 thread; host time on meta at GPU shapes, fastest of {options.rounds} interleaved rounds")
    hook_cost = _hook_call_cost()
    print(f"a module call with a forward hook: +{hook_cost * 1e6:.2f} us")
    print("| case | plain ms | full +ms | steady +ms | bytes +ms | plain again +ms (noise) | inside trim, steady ms "
          "(bytes) | the API's floor, ms | hooked calls | ops plain | +ops full | +ops steady | +ops bytes | saves changed "
          "| +ops per changed save (bytes) | +kernels per changed save (bytes) | syncs full / steady "
          "| held steady vs full | peak steady vs full | held / peak with bytes, memsave | gradients (bits, bytes) "
          "| inside trim on the CPU, small shapes, ms (bytes) |")
    print("|" + "---|" * 23)
    meta_cases, cpu_cases = cases("meta", False), cases("cpu", True)
    for name in options.cases:
        model, args, kwargs, loss = meta_cases[name]()
        times = host_times(model, args, kwargs, loss, options.rounds)
        ops = op_counts(model, args, kwargs, loss)
        inside, hooked = trim_own_time(model, args, kwargs, loss, "bits", options.rounds)
        inside_bytes, _ = trim_own_time(model, args, kwargs, loss, "bytes", options.rounds)
        floor = api_floor(model, args, kwargs, loss, options.rounds) + hooked * hook_cost
        inside += hooked * hook_cost
        inside_bytes += hooked * hook_cost
        del model
        plain_ops = ops["plain"][0]
        changed = ops["changed"]
        added = ops["steady"][0] - plain_ops
        added_bytes = ops["bytes"][0] - plain_ops
        per_save = f"{added / changed:.2f} ({added_bytes / changed:.2f})" if changed else "-"
        kernels = [ops[how][2] - ops["plain"][2] for how in ("steady", "bytes")]
        kernels_per_save = f"{kernels[0] / changed:.2f} ({kernels[1] / changed:.2f})" if changed else \
            f"{kernels[0]:+d} ({kernels[1]:+d})"
        held = peak = grads = on_cpu = against = "-"
        if not options.no_bytes:
            cpu_inside = [trim_own_time(*cpu_cases[name](), masks, options.rounds)[0] for masks in ("bits", "bytes")]
            on_cpu = f"{cpu_inside[0] * 1e3:.2f} ({cpu_inside[1] * 1e3:.2f})"
            steady_figures, full_figures, same = bytes_and_gradients(cpu_cases[name])
            held = (f"{steady_figures['held_after']:,} vs {full_figures['held_after']:,} "
                    f"({_change(steady_figures['held_after'], full_figures['held_after'])})")
            peak = (f"{steady_figures['peak_after']:,} vs {full_figures['peak_after']:,} "
                    f"({_change(steady_figures['peak_after'], full_figures['peak_after'])})")
            grads = "bit-identical" if same else "DIFFER"
            if name.startswith("resnet50"):
                against = bytes_and_memsave(cpu_cases[name])
        ms = {how: value * 1e3 for how, value in times.items()}
        print(f"| {name} | {ms['plain']:.1f} | {ms['full'] - ms['plain']:+.2f} | {ms['steady'] - ms['plain']:+.2f} "
              f"| {ms['bytes'] - ms['plain']:+.2f} | {ms['plain2'] - ms['plain']:+.2f} "
              f"| {inside * 1e3:.2f} ({inside_bytes * 1e3:.2f}) | {floor * 1e3:.2f} | {hooked} | {plain_ops} "
              f"| {ops['full'][0] - plain_ops:+d} | {added:+d} | {added_bytes:+d} | {changed} | {per_save} | {kernels_per_save} | {ops['full'][1] - ops['plain'][1]} / {ops['steady'][1] - ops['plain'][1]} "
              f"| {held} | {peak} | {against} | {grads} | {on_cpu} |", flush=True)


def _change(new: int, old: int) -> str:
    return f"{100.0 * (new - old) / old:+.2f}%" if old else "0"


if __name__ == "__main__":
    main()
