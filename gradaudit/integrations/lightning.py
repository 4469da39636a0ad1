"""``GradauditCallback`` for ``lightning.pytorch.Trainer``, and Lightning's model summary with the bytes each
top-level module holds for backward.

    from gradaudit.integrations.lightning import GradauditCallback
    trainer = lightning.pytorch.Trainer(max_steps=100, callbacks=[GradauditCallback(trim=True)])

At the first ``on_train_batch_start`` it audits the module's ``training_step`` on the fit loop's first batch
as the step is about to get it (fetched by the loop, moved to the device by the strategy and the module's
batch-transfer hooks), under the precision plugin's step context (its autocast), in the modes the modules
are in (Lightning trains them so). The HTML and JSON reports are written by global rank zero; the figures
(``gradaudit/held_bytes`` ...) go to every logger of the Trainer (``logger.log_metrics`` at step 0: exact
integers; ``self.log`` would store them as float32, exact only up to 16 MiB); Lightning's model summary is
logged again with a "Held for backward" column. ``gradaudit.trim`` and/or the plan for ``plan_budget`` are
installed on the module before that first step and removed at ``on_train_end`` (or ``on_exception``).

The audit runs ``training_step`` once outside the loop: the module's ``self.log`` calls during it are
skipped (they would log a step that did not happen). Manual optimization (the step runs its own backward)
cannot be audited this way and is refused.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_summary import ModelSummary
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from ..errors import GradauditError
from ..planning.apply import Forwards
from ..records import Report
from ..report.units import human_bytes
from .session import CallbackOptions, SessionResults, TrainingSession

__all__ = ["GradauditCallback", "HeldSummary"]

HELD_COLUMN = "Held for backward"


class GradauditCallback(SessionResults, pl.Callback):
    """Audit the first training batch, report and log it, and trim and/or plan the module for the run.

    The options are those of ``gradaudit.integrations.transformers.GradauditCallback``: ``report`` (HTML
    path, JSON beside it; None writes neither), ``trim``, ``plan_budget`` (bytes or a size such as
    ``"8GiB"``: the plan for it is applied for the run), ``fail_on_waste`` (raise before the first step
    when the first batch's forward holds memory autograd does not need) and ``fit_memory`` (the whole
    training step fitted with the trainer's first optimizer; where it does not fit, the cheapest remedy is
    installed for the run, and where none makes it fit, an error is raised before the first step).
    """

    def __init__(self, report: Optional[str] = "gradaudit-report.html", trim: bool = False,
                 plan_budget: Union[int, str, None] = None, fail_on_waste: bool = False,
                 fit_memory: Union[int, str, None] = None) -> None:
        self.options = CallbackOptions.checked(report, trim, plan_budget, fail_on_waste, fit_memory)
        self.session = TrainingSession(self.options)
        self.figures: dict[str, int] = {}
        self.summary: Optional[str] = None
        self._step: Optional[_StepTrimmed] = None
        self._audited = False

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not pl_module.automatic_optimization:
            raise GradauditError("GradauditCallback audits training_step with automatic optimization; this module "
                                 "optimizes manually (its step runs backward itself): audit its forward with "
                                 "gradaudit.audit(model, batch) instead")
        self._audited = False

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        # the fit loop's first batch, as training_step is about to get it (fetched before on_train_start,
        # moved to the device by the strategy and the module's transfer hooks)
        if self._audited:
            return
        self._audited = True
        with _training_step_as_forward(trainer, pl_module):
            self.figures = self.session.begin(pl_module, (batch, batch_idx), write=trainer.is_global_zero,
                                              train_mode=False,
                                              optimizer=trainer.optimizers[0] if trainer.optimizers else None,
                                              title=f"gradaudit: {type(pl_module).__name__} (Lightning, first batch)")
        trimming = self.session.trim_handle
        if trimming is not None:
            # Lightning calls training_step, not the module: trim follows the step (a hook on the module's
            # call alone would never see a step that calls only its submodules)
            self._step = _StepTrimmed(pl_module, trimming)
        for logger in trainer.loggers:
            logger.log_metrics(dict(self.figures), step=trainer.global_step)
        if trainer.is_global_zero:
            self.summary = str(HeldSummary(pl_module, self.session.report))
            rank_zero_info(f"gradaudit: activation bytes held for backward after the first batch's forward\n"
                           f"{self.summary}")

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._end()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._end()

    def remove(self) -> None:
        """Take trim and the plan off the module (``on_train_end`` and ``on_exception`` do)."""
        self._end()

    def _end(self) -> None:
        if self._step is not None:
            self._step.remove()
            self._step = None
        self.session.end()


class _StepTrimmed:
    """``pl_module.training_step`` run inside ``trimming.forward``: trim covers the whole step. ``remove``
    puts back the method as it was (the class's, or the module's own attribute)."""

    def __init__(self, pl_module: nn.Module, trimming: Any) -> None:
        self.pl_module = pl_module
        self.own = pl_module.__dict__.get("training_step")
        step = pl_module.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            with trimming.forward(*args, **kwargs):
                return step(*args, **kwargs)

        pl_module.training_step = training_step

    def remove(self) -> None:
        self.pl_module.__dict__.pop("training_step", None)
        if self.own is not None:
            self.pl_module.training_step = self.own


class HeldSummary(ModelSummary):
    """Lightning's model summary (``ModelSummary(module, max_depth)``) with one more column: the bytes
    autograd holds for backward in each listed module (its saves and its children's, each storage counted
    once, at the module of its first save), from a gradaudit report of ``module``."""

    def __init__(self, model: "pl.LightningModule", report: Report, max_depth: int = 1) -> None:
        self._held = {m.path: m.total_bytes for m in report.modules}
        super().__init__(model, max_depth=max_depth)

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        columns = super()._get_summary_data()
        rows = len(columns[0][1])  # the layers, and a row for parameters outside them where there are some
        held = [human_bytes(self._held.get(name, 0)) for name in self.layer_names]
        return [*columns, (HELD_COLUMN, held + ["n/a"] * (rows - len(held)))]


def _skip_logging(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during the audit's training_step: a step that did not happen logs nothing."""


@contextlib.contextmanager
def _training_step_as_forward(trainer: "pl.Trainer", pl_module: nn.Module) -> Iterator[None]:
    """While in force, calling ``pl_module(batch, batch_idx)`` runs its ``training_step`` as the strategy runs
    it (the precision plugin's step context), without logging; the module is as it was afterwards."""
    replaced = Forwards()

    def step(batch: Any, batch_idx: int) -> Any:
        with trainer.strategy.precision_plugin.train_step_context():
            return pl_module.training_step(batch, batch_idx)

    kept = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}
    replaced.replace(pl_module, step)
    try:
        pl_module.log = _skip_logging
        pl_module.log_dict = _skip_logging
        yield
    finally:
        replaced.restore()
        for name in ("log", "log_dict"):
            pl_module.__dict__.pop(name, None)
        pl_module.__dict__.update(kept)
