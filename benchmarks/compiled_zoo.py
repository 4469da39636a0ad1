"""Compiled models audited as their users run them: Hugging Face architectures (tests/hf_zoo.py, built from
small configs, trained as users train them) and torchvision models, each torch.compile'd, then audited.

Per model it compares the audit with an independent count of a plain run of the same compiled model (the
storages every node of its autograd graph keeps, ``CompiledFunctionBackward``'s saved tensors included,
beside the parameters, buffers and inputs), and the audit with its proof (``verify=True``):
- regions: compiled regions the plain run made / the audit saw (a graph break the audit caused shows here);
- bytes: the plain run's / the audit's;
- named: saves on a module path the model does not have (none expected), and those on the root module
  that the loss's code did not make (the model's own forward: legitimate where it computes something);
- verdicts: saves without one ("unknown"), and saves whose verdict read off the backward graph differs
  from the proof's, but for a running statistics buffer (the graph says "needed", as the eager rules do:
  a claim worth 0 bytes);
- findings: the rule codes the audit reports.
A row is OK when the regions and bytes agree, no save has an unknown module and no verdict disagrees.

    python benchmarks/compiled_zoo.py                                   # every architecture, aot_eager
    python benchmarks/compiled_zoo.py --backend inductor --hf LlamaForCausalLM,BertForMaskedLM --vision resnet18
    python benchmarks/compiled_zoo.py --hf "" --vision resnet18,mobilenet_v3_small,swin_t
    python benchmarks/compiled_zoo.py --meta                            # and each on meta, for cpu and cuda

Inductor needs a C++ compiler; each model compiles in seconds (aot_eager) to tens of seconds (inductor).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_compiled_and_meta import graph_saves, save_rows  # noqa: E402  (the tests' count and comparison)

VISION = "resnet18,mobilenet_v3_small,efficientnet_b0,convnext_tiny,swin_t,regnet_y_400mf,densenet121,squeezenet1_1"


def _running_statistics(t: Any) -> bool:
    return t.storage_kind == "buffer"


def on_meta(name: str, build_meta: Any, inputs: Any, backend: str, on_cpu: Any) -> list[str]:
    """Two rows: the same model built on the meta device (``build_meta()``), compiled and audited standing
    for the CPU (checked save by save against ``on_cpu``, the CPU's audit) and for CUDA (regions, bytes
    and verdicts only: no GPU here to compare with)."""
    import gradaudit
    from gradaudit.compiled import compiled_regions

    rows = []
    for target in ("cpu", "cuda"):
        start = time.time()
        meta = build_meta()
        torch._dynamo.reset()
        try:
            report = gradaudit.audit(torch.compile(meta, backend=backend), inputs, target=target)
        except Exception as error:  # noqa: BLE001 - a row, not the end of the run
            first = str(error).splitlines()[0][:160]
            rows.append(f"ERR {name + ' meta ' + target:34s} {type(error).__name__}: {first}")
            continue
        finally:
            torch._dynamo.reset()
        seen, cpu_seen = compiled_regions(report), compiled_regions(on_cpu)
        unknown = sum(1 for t in report.tensors if t.verdict == "unknown")
        same = save_rows(report) == save_rows(on_cpu) if target == "cpu" else None
        ok = seen == cpu_seen and not unknown and same is not False
        compared = {True: "saves as the CPU audit", False: "saves differ from the CPU audit", None: ""}[same]
        rows.append(f"{'OK ' if ok else 'BAD'} {name + ' meta ' + target:34s} regions {cpu_seen}/{seen}  bytes "
                    f"{on_cpu.saved_bytes:,}/{report.saved_bytes:,}  "
                    f"{compared}"
                    f"  unknown {unknown}  findings {','.join(sorted({f.code for f in report.findings})) or '-'}  "
                    f"{time.time() - start:.0f}s")
    return rows


def check(name: str, model: torch.nn.Module, inputs: Any, backend: str, loss_of: Any, build_meta: Any = None) -> str:
    """One row: the compiled model's plain run against its audit and its proof (with ``build_meta``, the
    same model's builder on meta, the rows of ``on_meta`` after it)."""
    import gradaudit

    start = time.time()
    modules = {path for path, _ in model.named_modules()}
    tensors = list(inputs.values()) if isinstance(inputs, dict) else [inputs]
    alive = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *tensors]}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    call = (lambda: compiled(**inputs)) if isinstance(inputs, dict) else (lambda: compiled(inputs))
    try:
        loss = loss_of(call())
        regions, held = graph_saves(loss, alive)
        del loss
        report = gradaudit.audit(compiled, inputs)
        proven = gradaudit.audit(compiled, inputs, verify=True)
    except Exception as error:  # noqa: BLE001 - a row, not the end of the run
        return f"ERR {name:34s} {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    finally:
        torch._dynamo.reset()
    seen = sum(n.name == "CompiledFunctionBackward" for n in report.nodes)
    unknown_module = sorted({t.module for t in report.tensors if t.module not in modules})
    root = sum(1 for t in report.tensors if t.module == "" and not t.source.startswith("transformers/loss/"))
    unknown = sum(1 for t in report.tensors if t.verdict == "unknown")
    differ = [t for t, p in zip(report.tensors, proven.tensors)
              if t.verdict != p.verdict and not _running_statistics(t)]
    ok = seen == regions and held == report.saved_bytes and not unknown_module and not unknown and not differ
    row = (f"{'OK ' if ok else 'BAD'} {name:34s} regions {regions}/{seen}  bytes {held:,}/{report.saved_bytes:,}  "
           f"off-model {len(unknown_module)} root {root}  unknown {unknown} differ {len(differ)}  "
           f"findings {','.join(sorted({f.code for f in report.findings})) or '-'}  {time.time() - start:.0f}s")
    return "\n".join([row, *on_meta(name, build_meta, inputs, backend, report)]) if build_meta else row


def hugging_face(names: list[str], backend: str, meta: bool) -> None:
    import transformers
    from hf_zoo import ARCHS, batch, build_model

    def built(arch: Any, device: str = "cpu") -> torch.nn.Module:
        model = build_model(arch, transformers, device=device)
        if device == "meta":
            # a parameter made by torch.Tensor(n) ignores torch.device and stays on the CPU (Wav2Vec2's
            # masked_spec_embed): on meta too, as it would be on the GPU with the rest of the model
            for module in model.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and not p.is_meta:
                        module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
        try:
            model.get_input_embeddings().requires_grad_(False)  # frozen embeddings, as fine-tunes have them
        except (NotImplementedError, AttributeError):
            pass
        return model

    for arch in ARCHS:
        if names and arch.model not in names:
            continue
        inputs = batch(arch, padded=arch.batch in ("text", "audio"))
        loss_of = (lambda out: out.loss) if "labels" in inputs else (lambda out: out[0].float().sum())
        build_meta = (lambda arch=arch: built(arch, "meta")) if meta else None
        print(check(arch.model, built(arch), inputs, backend, loss_of, build_meta), flush=True)


def vision(names: list[str], backend: str, meta: bool) -> None:
    import torchvision

    import gradaudit

    def built(name: str) -> torch.nn.Module:
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(num_classes=10)
        # the last quarter of the parameters trains, the rest is frozen; batch norm in training
        model.requires_grad_(False)
        parameters = list(model.parameters())
        for p in parameters[-len(parameters) // 4:]:
            p.requires_grad_(True)
        return model.train()

    def built_on_meta(name: str) -> torch.nn.Module:
        with gradaudit.meta_device():  # RegNet reads the sizes it computes while it is built
            return built(name)

    for name in names:
        build_meta = (lambda name=name: built_on_meta(name)) if meta else None
        print(check(name, built(name), torch.randn(2, 3, 64, 64), backend, lambda out: out.sum(), build_meta),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager", help="torch.compile's backend (aot_eager, inductor, ...)")
    parser.add_argument("--hf", default=None, help="comma-separated architectures of tests/hf_zoo.py (default: all; "
                                                    "'' for none)")
    parser.add_argument("--vision", default=VISION, help="comma-separated torchvision models ('' for none)")
    parser.add_argument("--meta", action="store_true", help="also audit each model on the meta device, standing for "
                                                            "the CPU (checked save by save against the CPU audit) "
                                                            "and for CUDA")
    options = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    print(f"torch {torch.__version__}, backend {options.backend}, CPU, one thread")
    if options.hf != "":
        hugging_face([n for n in (options.hf or "").split(",") if n], options.backend, options.meta)
    if options.vision:
        vision(options.vision.split(","), options.backend, options.meta)


if __name__ == "__main__":
    main()
