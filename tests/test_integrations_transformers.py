"""GradauditCallback in a real Hugging Face Trainer on CPU: a tiny GPT-2 built from a config, a collator that
pads (no tokenizer), 3 steps. The callback's report and logged figures, and training that is bit-identical
with trim (to the run without the callback) and with a plan (to Hugging Face's own checkpointing)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra installs it

import gradaudit  # noqa: E402
from gradaudit.integrations.transformers import GradauditCallback  # noqa: E402

STEPS, BATCH = 3, 4
# GPT-2's layers each hold their attention probabilities and dropout masks: waste a trim removes
CONFIG = dict(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, use_cache=False,
              bos_token_id=0, eos_token_id=0)


def build_model():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))


def dataset():
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, 12, (STEPS * BATCH * 2,), generator=generator)
    return [{"input_ids": torch.randint(1, 64, (int(n),), generator=generator).tolist()} for n in lengths]


def pad_collator(rows):
    """Pads to the longest row with id 0; attention_mask 0 and label -100 on the padding."""
    length = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, :len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def checkpointing_argument():
    """transformers 5 renamed TrainingArguments.gradient_checkpointing to activation_checkpointing."""
    fields = transformers.TrainingArguments.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


class Run:
    """One Trainer.train() of a fresh model; every forward's keyword arguments are kept (the audit's too)."""

    def __init__(self, tmp_path, callbacks=(), **arguments):
        self.model = build_model()
        self.forwards = []
        hook = self.model.register_forward_pre_hook(
            lambda module, args, kwargs: self.forwards.append({k: v.clone() for k, v in kwargs.items()}),
            with_kwargs=True)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
            report_to=[], save_strategy="no", logging_steps=1, seed=0, use_cpu=True, disable_tqdm=True, **arguments)
        self.trainer = transformers.Trainer(model=self.model, args=args, train_dataset=dataset(),
                                            data_collator=pad_collator, callbacks=list(callbacks))
        try:
            self.trainer.train()
        finally:
            hook.remove()
        self.losses = [entry["loss"] for entry in self.trainer.state.log_history if "loss" in entry]
        self.parameters = {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def logged(self):
        return [entry for entry in self.trainer.state.log_history if any(k.startswith("gradaudit/") for k in entry)]

    def same_training(self, other):
        return self.losses == other.losses and all(torch.equal(p, other.parameters[name])
                                                   for name, p in self.parameters.items())


class Registered(transformers.TrainerCallback):
    """Notes, at on_train_begin, whether the train dataloader is registered with accelerate's gradient state."""

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        from accelerate.state import GradientState

        self.registered = any(r is train_dataloader for r in GradientState().dataloader_references)


class Reporter(transformers.TrainerCallback):
    """Stands for a reporting integration (W&B, TensorBoard), which the Trainer lists before user callbacks."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trimmed")
    reporter, callback = Reporter(), GradauditCallback(report=str(folder / "first-batch.html"), trim=True)
    registered = Registered()
    run = Run(folder, [reporter, callback, registered])
    run.folder, run.reporter, run.callback = folder, reporter, callback
    run.registered_after_callback = registered.registered
    return run


def test_trim_trains_bit_identically_to_the_run_without_the_callback(plain, trimmed):
    assert len(plain.losses) == STEPS
    assert trimmed.same_training(plain)
    # ... and trim acted in every step: dropout masks bit-packed
    assert trimmed.callback.trim_stats["bitpacked"] >= STEPS, trimmed.callback.trim_stats


def test_the_audited_batch_is_the_first_batch_the_trainer_trains_on(trimmed):
    # forwards: the callback's audit (GPT-2's attention dropout makes it run a second forward, to measure
    # the model without it), then one per step (trim adds none); the draw left the loader's shuffle as it
    # was, so the trained batches are the plain run's too (same losses above)
    audits, steps = trimmed.forwards[:-STEPS], trimmed.forwards[-STEPS:]
    assert audits and all(a.keys() == {"input_ids", "attention_mask", "labels"} for a in audits)
    # the Trainer adds the count of labels it divides the loss by; the audit's forward leaves it out
    assert steps[0].keys() == {"input_ids", "attention_mask", "labels", "num_items_in_batch"}
    assert all(torch.equal(audit[k], steps[0][k]) for audit in audits for k in audit)
    assert (audits[0]["attention_mask"] == 0).any()  # the collator padded this batch


def test_taking_the_batch_leaves_the_accelerators_state_alone(trimmed):
    # accelerate's dataloader registers with the gradient state (which gradient accumulation's end-of-data
    # sync reads) while iterated, until exhausted: the callback's draw must leave no registration behind
    assert trimmed.registered_after_callback is False


def test_logged_figures_are_the_audits_of_that_batch(trimmed):
    model = build_model().train()
    report = gradaudit.audit(model, trimmed.forwards[0])
    expected = {
        "gradaudit/held_bytes": report.saved_bytes,
        "gradaudit/reclaimable_bytes": report.reclaimable_bytes,
        "gradaudit/reclaimable_with_bitpacking_bytes": report.reclaimable_with_bitpacking_bytes,
        "gradaudit/waste_findings": len(report.waste_findings),
        # what trim leaves: it drops and bit-packs exactly the audit's reclaimable-with-bit-packing bytes
        "gradaudit/trimmed_held_bytes": report.saved_bytes - report.reclaimable_with_bitpacking_bytes,
    }
    assert report.reclaimable_with_bitpacking_bytes > 0 and report.waste_findings  # dropout masks at least
    assert trimmed.logged() == [{**expected, "step": 0}]  # state.log_history, before the first step
    assert trimmed.reporter.logs[0] == expected  # a reporting integration's on_log got them too
    assert trimmed.callback.figures == expected


def test_report_files_are_written(trimmed):
    html = (trimmed.folder / "first-batch.html").read_text(encoding="utf-8")
    document = json.loads((trimmed.folder / "first-batch.json").read_text(encoding="utf-8"))
    assert html.startswith("<!DOCTYPE html>") and "GPT2LMHeadModel" in html
    assert document["model"] == "GPT2LMHeadModel" and document["training"] is True
    assert document["summary"]["saved_bytes"] == trimmed.callback.figures["gradaudit/held_bytes"]


def test_the_model_is_as_it_was_after_training(trimmed):
    from gradaudit.trimming import is_trimmed

    assert not is_trimmed(trimmed.model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in trimmed.model.modules())
    assert not any("forward" in m.__dict__ for m in trimmed.model.modules())


def test_a_plan_trains_bit_identically_to_hugging_faces_own_checkpointing(tmp_path, plain):
    # every block checkpointed, as Hugging Face checkpoints them: the budget is the least a plan of the
    # first batch (the plain run's first step) holds
    first = {k: v for k, v in plain.forwards[0].items() if k != "num_items_in_batch"}
    probe = gradaudit.plan(build_model().train(), first, 1 << 40, measure_peak=False)
    callback = GradauditCallback(report=None, plan_budget=min(held for held, _ in probe.frontier))
    planned = Run(tmp_path / "planned", [callback])
    assert callback.plan.checkpointed == ("transformer.h.0", "transformer.h.1")
    assert planned.logged()[0]["gradaudit/plan_held_bytes"] == callback.plan.held_bytes
    assert not any("forward" in m.__dict__ for m in planned.model.modules())  # removed at on_train_end
    hugging_face = Run(tmp_path / "hf", **{checkpointing_argument(): True})
    # recomputation with the forward's RNG state restored: identical to each other and to no checkpointing
    assert planned.same_training(hugging_face) and planned.same_training(plain)


@pytest.mark.parametrize("setting", ["bf16", "checkpointing"])
def test_the_audit_runs_the_model_as_the_trainer_will(tmp_path, trimmed, setting):
    # bf16: accelerate puts CPU autocast on the model's forward; checkpointing: the Trainer turns Hugging
    # Face's activation checkpointing on before on_train_begin. The audit sees both, as the steps run them
    callback = GradauditCallback(report=None)
    Run(tmp_path, [callback], **({"bf16": True} if setting == "bf16" else {checkpointing_argument(): True}))
    report, plain_held = callback.report, trimmed.callback.figures["gradaudit/held_bytes"]
    assert report.saved_bytes < plain_held
    if setting == "bf16":
        assert any(t.dtype == "bfloat16" for t in report.tensors)
    else:
        assert {str(t.managed_by) for t in report.tensors} == {"autograd", "checkpoint"}


def test_fail_on_waste_stops_before_the_first_step(tmp_path):
    callback = GradauditCallback(report=None, trim=True, fail_on_waste=True)
    with pytest.raises(gradaudit.GradauditError, match=r"fail_on_waste: .* \(6 waste findings: GA402, GA801\)"):
        Run(tmp_path, [callback])
    assert not callback.session.installed  # it stopped before installing trim


def test_remove_takes_trim_off_when_training_raises(tmp_path):
    from gradaudit.trimming import is_trimmed

    class Stop(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise RuntimeError("stopped")

    callback = GradauditCallback(report=None, trim=True)
    with pytest.raises(RuntimeError, match="stopped"):
        Run(tmp_path, [callback, Stop()])
    model = callback.session.trim_handle._model_ref()
    assert is_trimmed(model)  # the Trainer called no on_train_end
    callback.remove()
    assert not is_trimmed(model) and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_plan_budget_refuses_the_trainers_own_checkpointing(tmp_path):
    with pytest.raises(gradaudit.GradauditError, match="replaces the model's own activation checkpointing"):
        Run(tmp_path, [GradauditCallback(report=None, plan_budget="1MiB")], **{checkpointing_argument(): True})


@pytest.mark.parametrize("options, message", [
    (dict(trim="yes"), "trim must be True or False"),
    (dict(fail_on_waste=1), "fail_on_waste must be True or False"),
    (dict(plan_budget="lots"), "malformed size"),
    (dict(plan_budget=-1), "must not be negative"),
    (dict(report="report.txt"), "ending in .html"),
    (dict(report=3), "must be a path"),
])
def test_unknown_option_values_are_errors(options, message):
    with pytest.raises(gradaudit.GradauditError, match=message):
        GradauditCallback(**options)


# -- fit_memory: the whole step fitted with the Trainer's optimizer, its remedy installed for the run --------


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    callback = GradauditCallback(report=None, fit_memory="1GiB")
    run = Run(tmp_path_factory.mktemp("fitted"), [callback])
    run.callback = callback
    return run


def test_fit_memory_logs_the_steps_predicted_peak_which_a_real_step_measures(fitted, plain):
    from gradaudit.measure import measured_step_peak

    logged = fitted.logged()[0]
    assert logged["gradaudit/step_fits"] == 1 and "gradaudit/remedy_step_peak_bytes" not in logged
    # the Trainer's optimizer (AdamW, two parameter groups) rebuilt on stand-ins: a real step on the first batch,
    # measured by the independent tracker, peaks where the callback said
    batch = fitted.forwards[0]
    used = getattr(fitted.trainer.optimizer, "optimizer", fitted.trainer.optimizer)  # inside accelerate's wrapper
    assert fitted.callback.fit.optimizer == type(used).__name__

    def same_optimizer(parameters):
        import inspect

        accepted = inspect.signature(type(used)).parameters  # its implementation (foreach, fused) as the Trainer chose
        return type(used)(parameters, **{k: v for k, v in used.defaults.items() if k in accepted})

    # the Run's forward hook keeps a copy of every forward's inputs (960 bytes here), the fitted step's too:
    # the measured model has the same hook
    model, kept = build_model(), []
    model.register_forward_pre_hook(lambda module, args, kwargs: kept.append({k: v.clone() for k, v in kwargs.items()}),
                                    with_kwargs=True)
    measured = measured_step_peak(model, batch, same_optimizer, lambda output: output.loss)
    assert logged["gradaudit/step_peak_bytes"] == fitted.callback.fit.peak_bytes == measured
    assert fitted.same_training(plain)  # a step that fits: nothing installed


def test_fit_memory_below_the_peak_installs_the_remedy_and_training_stays_bit_identical(fitted, plain, tmp_path):
    peak = fitted.callback.fit.peak_bytes
    callback = GradauditCallback(report=None, fit_memory=peak * 95 // 100)
    run = Run(tmp_path, [callback])
    remedy = callback.fit.remedy
    assert remedy is not None and remedy.peak_bytes <= peak * 95 // 100
    logged = run.logged()[0]
    assert logged["gradaudit/step_fits"] == 0 and logged["gradaudit/remedy_step_peak_bytes"] == remedy.peak_bytes
    assert run.same_training(plain)
    assert run.model.forward.__func__ is type(run.model).forward  # the remedy is off the model afterwards


def test_fit_memory_that_nothing_fits_stops_before_the_first_step(tmp_path):
    with pytest.raises(gradaudit.GradauditError, match="no trim or checkpoint plan brings it within"):
        Run(tmp_path, [GradauditCallback(report=None, fit_memory="64KB")])
    with pytest.raises(gradaudit.GradauditError, match="not both"):
        GradauditCallback(fit_memory="1GiB", trim=True)
