"""The whole training step's peak, predicted by ``gradaudit.fit`` beside other estimators, in one run.

    python benchmarks/bench_fit.py            # every model below, SGD with momentum, Adam and AdamW
    python benchmarks/bench_fit.py --quick    # one CNN and one decoder, AdamW only

For each model (torchvision ResNet-18 and a ViT, GPT-2, Llama and BERT from configs, a peft LoRA
Llama; small sizes, CPU, float32, one thread) and optimizer:
- measured: the peak bytes alive through a real steady-state step on the CPU (``measure.measured_step_peak``:
  a warm-up step, then forward, loss, backward and optimizer step under an independent storage tracker,
  plus parameters, buffers, the batch and the optimizer's state);
- gradaudit: ``gradaudit.fit`` on the CPU model, and on a meta copy of it (which must give the same figure);
- MemTracker: torch.distributed._tools.mem_tracker.MemTracker's peak over two real steps (the second
  measured), plus the batch's bytes, which it does not track (it is given the model and optimizer);
- accelerate: ``accelerate estimate-memory``'s training figure for the model's float32 size (its
  ``estimate_training_usage``: the largest of weights, gradients, Adam's state and the step, 4x the
  weights; it knows no batch, activations or optimizer but Adam);
and each one's error against the measured peak. Time: gradaudit's fit (CPU and meta) as a ratio to one
plain training step (the median of three, timed in this run), and a plain-against-plain ratio (two
identical steps) as the noise floor.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPTIMIZERS = {
    "sgd+momentum": functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9),
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def hf_loss(output):
    return output.loss


def logits_loss(output):
    return output.logsumexp(-1).mean()


def decoder_batch(vocab: int, batch: int = 4, sequence: int = 128) -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, sequence), generator=generator)
    mask = torch.ones(batch, sequence, dtype=torch.long)
    mask[1, sequence - 32:] = 0  # a padded batch, as collators make
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def models(quick: bool):
    import torchvision
    import transformers

    torch.manual_seed(0)
    yield "resnet18 8x3x64x64", torchvision.models.resnet18(num_classes=10).train(), torch.randn(8, 3, 64, 64), logits_loss
    if quick:
        config = transformers.LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=256, vocab_size=1000,
                                          use_cache=False)
        yield "llama 4L h128 4x128", transformers.LlamaForCausalLM(config).train(), decoder_batch(1000), hf_loss
        return
    yield ("vit 2L 4x3x64x64", torchvision.models.VisionTransformer(
        image_size=64, patch_size=16, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128, num_classes=10).train(),
        torch.randn(4, 3, 64, 64), logits_loss)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=128, n_layer=4, n_head=4, vocab_size=1000,
                                                                n_positions=128, bos_token_id=0, eos_token_id=0))
    yield "gpt2 4L h128 4x128 (use_cache on)", gpt2.train(), decoder_batch(1000), hf_loss
    llama_config = transformers.LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=256, vocab_size=1000,
                                            use_cache=False)
    yield "llama 4L h128 4x128", transformers.LlamaForCausalLM(llama_config).train(), decoder_batch(1000), hf_loss
    bert = transformers.BertForMaskedLM(transformers.BertConfig(hidden_size=128, num_hidden_layers=4,
                                                                num_attention_heads=4, intermediate_size=256,
                                                                vocab_size=1000, max_position_embeddings=128))
    yield "bert-mlm 4L h128 4x128", bert.train(), decoder_batch(1000), hf_loss
    try:
        import peft
    except ImportError:
        return
    lora = peft.get_peft_model(transformers.LlamaForCausalLM(llama_config).train(),
                               peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    yield "llama 4L + LoRA r8", lora, decoder_batch(1000), hf_loss


def on_meta(model):
    """A meta copy of ``model`` with its weights tied as the original's (``.to("meta")`` makes a new
    parameter per module; Hugging Face models tie again with ``tie_weights``)."""
    copied = copy.deepcopy(model).to("meta")
    if hasattr(copied, "tie_weights"):
        copied.tie_weights()
    return copied


def memtracker_peak(model, inputs, make, loss_fn) -> int:
    """MemTracker's peak over the second of two real steps, plus the batch (which it does not track)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from gradaudit.tensors import iter_tensors, split_inputs, storage_key

    args, kwargs = split_inputs(inputs)
    weights = copy.deepcopy(model.state_dict())
    optimizer = make([p for p in model.parameters() if p.requires_grad])
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for step in range(2):
            if step == 1:
                tracker.reset_mod_stats()
            loss = loss_fn(model(*args, **kwargs))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
    model.load_state_dict(weights)
    batch = {storage_key(t): t.untyped_storage().nbytes() for t in iter_tensors((args, kwargs))}
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] + sum(batch.values())


def accelerate_figure(model) -> int:
    from accelerate.commands.estimate import estimate_training_usage

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(estimate_training_usage(weights, "float32").values())


def step_seconds(model, inputs, make, loss_fn, runs: int = 3) -> list[float]:
    from gradaudit.tensors import split_inputs

    args, kwargs = split_inputs(inputs)
    weights = copy.deepcopy(model.state_dict())
    optimizer = make([p for p in model.parameters() if p.requires_grad])
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        loss = loss_fn(model(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    model.load_state_dict(weights)
    return times[1:]


def error(figure, measured) -> str:
    return "n/a" if figure is None else f"{100 * (figure - measured) / measured:+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import gradaudit
    from gradaudit.measure import measured_step_peak

    names = ["adamw"] if options.quick else list(OPTIMIZERS)
    print(f"torch {torch.__version__}; CPU, float32, one thread; errors against the measured peak")
    header = (f"{'model':<36} {'optimizer':<13} {'measured':>11} {'gradaudit':>8} {'meta=cpu':>8} "
              f"{'MemTracker':>10} {'accelerate':>10} {'fit/step':>8} {'meta/step':>9} {'noise':>6}")
    print(header)
    exact = 0
    rows = 0
    for label, model, inputs, loss_fn in models(options.quick):
        meta_model = on_meta(model)
        for name in names:
            make = OPTIMIZERS[name]
            measured = measured_step_peak(model, inputs, make, loss_fn)
            start = time.perf_counter()
            fitted = gradaudit.fit(model, inputs, memory=2**40, optimizer=make, loss=loss_fn, remedy=False)
            fit_seconds = time.perf_counter() - start
            start = time.perf_counter()
            meta_fit = gradaudit.fit(meta_model, inputs, memory=2**40, optimizer=make, loss=loss_fn, remedy=False)
            meta_seconds = time.perf_counter() - start
            try:
                tracked = memtracker_peak(model, inputs, make, loss_fn)
            except Exception as failure:  # noqa: BLE001 (a column of the table, not a failure of the run)
                print(f"  MemTracker failed on {label}: {type(failure).__name__}: {failure}")
                tracked = None
            estimated = accelerate_figure(model)
            steps = step_seconds(model, inputs, make, loss_fn)
            step = statistics.median(steps)
            noise = steps[1] / steps[0]
            rows += 1
            exact += fitted.peak_bytes == measured
            print(f"{label:<36} {name:<13} {measured:>11} {error(fitted.peak_bytes, measured):>8} "
                  f"{'yes' if meta_fit.peak_bytes == fitted.peak_bytes else 'NO':>8} {error(tracked, measured):>10} "
                  f"{error(estimated, measured):>10} {fit_seconds / step:>7.1f}x {meta_seconds / step:>8.1f}x "
                  f"{noise:>5.2f}x")
    print(f"\ngradaudit exact on {exact} of {rows} (model, optimizer) pairs")


if __name__ == "__main__":
    main()
