"""GradauditCallback in a real Lightning Trainer on CPU: a small CNN whose training_step calls only its
submodules, a shuffled DataLoader, 3 steps. The callback's report, the figures the loggers get, the model
summary's held column, and training that is bit-identical with trim."""

import json

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")  # the test extra installs lightning

import gradaudit  # noqa: E402
from gradaudit.integrations.lightning import HELD_COLUMN, GradauditCallback  # noqa: E402

STEPS, BATCH = 3, 4


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        # max-pooling keeps its whole input (GA301), the ReLUs keep floats for a sign (GA401), dropout a mask
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.ReLU(), nn.Dropout(0.25),
                                  nn.Linear(16, 4))
        self.batches = []

    def training_step(self, batch, batch_idx):
        self.batches.append([t.clone() for t in batch])
        images, labels = batch
        loss = nn.functional.cross_entropy(self.head(self.features(images)), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordingLogger(pl.loggers.Logger):
    """Keeps every log_metrics call, as W&B or TensorBoard would get it."""

    def __init__(self):
        super().__init__()
        self.metrics = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))


def loader():
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(6 * BATCH, 3, 8, 8, generator=generator),
                                          torch.randint(0, 4, (6 * BATCH,), generator=generator))
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)


class Run:
    def __init__(self, callbacks=()):
        pl.seed_everything(0, verbose=False)
        self.model = Classifier()
        self.logger = RecordingLogger()
        trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=self.logger,
                             callbacks=list(callbacks), enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, log_every_n_steps=1)
        trainer.fit(self.model, loader())
        self.losses = [m["train_loss"] for _, m in self.logger.metrics if "train_loss" in m]
        self.parameters = {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def logged(self):
        return [(step, m) for step, m in self.logger.metrics if any(k.startswith("gradaudit/") for k in m)]

    def same_training(self, other):
        return self.losses == other.losses and all(torch.equal(p, other.parameters[name])
                                                   for name, p in self.parameters.items())


@pytest.fixture(scope="module")
def plain():
    return Run()


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trimmed")
    callback = GradauditCallback(report=str(folder / "first-batch.html"), trim=True)
    run = Run([callback])
    run.folder, run.callback = folder, callback
    return run


def test_trim_trains_bit_identically_and_trims(plain, trimmed):
    assert len(plain.losses) == STEPS
    assert trimmed.same_training(plain)
    # trim covered each training_step although it never calls the module itself: saves were dropped
    # (max-pooling's input) and bit-packed (ReLU results, the dropout mask) in every step
    stats = trimmed.callback.trim_stats
    assert stats["dropped"] >= STEPS and stats["bitpacked"] >= STEPS, stats


def test_the_audited_batch_is_the_first_the_fit_loop_trains_on(plain, trimmed):
    audited, *steps = trimmed.model.batches  # the audit ran training_step once first
    assert len(steps) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(audited, steps[0]))
    assert all(torch.equal(a, b) for a, b in zip(steps[0], plain.model.batches[0]))  # the shuffle is untouched


class Step(nn.Module):
    """Classifier.training_step's computation as a module's forward, for gradaudit.audit."""

    def __init__(self, classifier):
        super().__init__()
        self.features, self.head = classifier.features, classifier.head

    def forward(self, images, labels):
        return nn.functional.cross_entropy(self.head(self.features(images)), labels)


def test_loggers_get_the_audits_figures_of_that_batch(trimmed):
    report = gradaudit.audit(Step(Classifier()).train(), tuple(trimmed.model.batches[0]))
    # max-pooling's input is the first ReLU's result: dropping it alone frees nothing, bit-packing that ReLU does
    assert report.reclaimable_bytes == 0 and report.reclaimable_with_bitpacking_bytes > 0 and report.waste_findings
    expected = {
        "gradaudit/held_bytes": report.saved_bytes,
        "gradaudit/reclaimable_bytes": report.reclaimable_bytes,
        "gradaudit/reclaimable_with_bitpacking_bytes": report.reclaimable_with_bitpacking_bytes,
        "gradaudit/waste_findings": len(report.waste_findings),
        "gradaudit/trimmed_held_bytes": report.saved_bytes - report.reclaimable_with_bitpacking_bytes,
    }
    assert trimmed.logged() == [(0, expected)]  # every logger, at step 0, exact integers
    assert trimmed.callback.figures == expected


def test_report_files_are_written(trimmed):
    html = (trimmed.folder / "first-batch.html").read_text(encoding="utf-8")
    document = json.loads((trimmed.folder / "first-batch.json").read_text(encoding="utf-8"))
    assert html.startswith("<!DOCTYPE html>") and "Classifier" in html
    assert document["summary"]["saved_bytes"] == trimmed.callback.figures["gradaudit/held_bytes"]


def test_the_module_is_as_it_was_after_training(trimmed):
    from gradaudit.trimming import is_trimmed

    assert not is_trimmed(trimmed.model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in trimmed.model.modules())
    assert not {"forward", "training_step", "log", "log_dict"} & set(trimmed.model.__dict__)


def test_model_summary_has_a_held_column(trimmed):
    from gradaudit.report.units import human_bytes

    held = {m.path: m.total_bytes for m in trimmed.callback.report.modules}
    header, *rows = trimmed.callback.summary.splitlines()
    assert header.rstrip().endswith(HELD_COLUMN)
    for name in ("features", "head"):
        row = next(line for line in rows if f" {name} " in line)
        assert held[name] > 0 and row.rstrip().endswith(human_bytes(held[name])), row


def test_fail_on_waste_stops_before_the_first_step():
    callback = GradauditCallback(report=None, fail_on_waste=True)
    with pytest.raises(gradaudit.GradauditError, match=r"fail_on_waste: .* waste findings: GA301, GA401"):
        Run([callback])
    assert callback.session.installed is False


@pytest.mark.parametrize("options, message", [
    (dict(trim=1), "trim must be True or False"),
    (dict(plan_budget=[1]), "budget must be bytes"),
    (dict(report="r.json"), "ending in .html"),
])
def test_unknown_option_values_are_errors(options, message):
    with pytest.raises(gradaudit.GradauditError, match=message):
        GradauditCallback(**options)


def test_a_plan_trains_bit_identically(plain):
    # the head's two linear layers are the repeated blocks; the budget is the least a plan of them holds
    probe = gradaudit.plan(Step(Classifier()).train(), tuple(plain.model.batches[0]), 1 << 30, measure_peak=False)
    callback = GradauditCallback(report=None, plan_budget=min(held for held, _ in probe.frontier))
    planned = Run([callback])
    assert callback.plan.checkpointed and callback.plan.held_bytes < callback.report.saved_bytes
    assert planned.logged()[0][1]["gradaudit/plan_held_bytes"] == callback.plan.held_bytes
    assert planned.same_training(plain)  # recomputation restores the RNG: the dropout draws the same mask
    assert not any("forward" in m.__dict__ for m in planned.model.modules())  # removed at on_train_end


def test_fit_memory_logs_the_steps_peak_and_stops_before_training_where_nothing_fits(plain):
    fits = GradauditCallback(report=None, fit_memory="1GiB")
    run = Run([fits])
    (step, logged), = run.logged()
    peak = fits.fit.peak_bytes
    assert logged["gradaudit/step_peak_bytes"] == peak and logged["gradaudit/step_fits"] == 1
    assert fits.fit.optimizer == "SGD"  # the module's own optimizer (configure_optimizers)
    assert run.same_training(plain)
    # this small CNN peaks in backward, at its convolution's gradients, after every activation a remedy could
    # drop is gone: a byte less and nothing fits, which the callback says before the first step
    assert fits.fit.peak_phase == "backward"
    with pytest.raises(gradaudit.GradauditError, match="no trim or checkpoint plan brings it within"):
        Run([GradauditCallback(report=None, fit_memory=peak - 1)])
