"""What both trainer callbacks do, without any trainer: check the options, take the first batch of the
trainer's loader without disturbing it, audit it, write the reports, name the figures to log, and put
``gradaudit.trim`` and/or a checkpointing plan on the model for the run (and take them off again).
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..auditing import audit
from ..errors import GradauditError
from ..planning.switches import checkpoints_itself
from ..records import Report

# every figure a callback logs is named with this prefix (W&B, TensorBoard, state.log_history)
METRIC_PREFIX = "gradaudit/"
REPORT_SUFFIXES = (".html", ".htm")


@dataclass(frozen=True)
class CallbackOptions:
    """A callback's options, checked: ``report`` (the HTML report's path, its JSON beside it with the
    suffix ``.json``; None writes neither), ``trim``, ``plan_budget`` (bytes; None: no plan) and
    ``fail_on_waste``."""

    report: Optional[Path]
    trim: bool
    plan_budget: Optional[int]
    fail_on_waste: bool
    fit_memory: Optional[int] = None

    @classmethod
    def checked(cls, report: Any, trim: Any, plan_budget: Any, fail_on_waste: Any,
                fit_memory: Any = None) -> "CallbackOptions":
        from ..sizes import as_bytes

        if report is not None and not isinstance(report, (str, os.PathLike)):
            raise GradauditError(f"report must be a path ending in .html (or None for no report), not {report!r}")
        path = Path(report) if report is not None else None
        if path is not None and path.suffix.lower() not in REPORT_SUFFIXES:
            raise GradauditError(f"report={str(report)!r}: give the HTML report's path, ending in .html (the JSON "
                                 f"report is written beside it, ending in .json), or None for no report")
        for name, value in (("trim", trim), ("fail_on_waste", fail_on_waste)):
            if not isinstance(value, bool):
                raise GradauditError(f"{name} must be True or False, not {value!r}")
        budget = as_bytes(plan_budget) if plan_budget is not None else None
        memory = as_bytes(fit_memory, "memory") if fit_memory is not None else None
        if memory is not None and (trim or budget is not None):
            raise GradauditError("fit_memory chooses trim and the checkpoint plan itself (the cheapest change that "
                                 "makes the step fit): give fit_memory, or trim/plan_budget, not both")
        return cls(path, trim, budget, fail_on_waste, memory)

    @property
    def json_report(self) -> Optional[Path]:
        return self.report.with_suffix(".json") if self.report is not None else None


def figures(report: Report, plan: Any = None, trimmed: bool = False, fitted: Any = None) -> dict[str, int]:
    """The figures a callback logs, named with METRIC_PREFIX: what autograd holds for backward after the
    first batch's forward, what it need not hold, and, with a plan or trim, what the model holds under them;
    with fit_memory, the predicted peak of a whole training step (and under the remedy installed)."""
    logged = {
        "held_bytes": report.saved_bytes,
        "reclaimable_bytes": report.reclaimable_bytes,
        "reclaimable_with_bitpacking_bytes": report.reclaimable_with_bitpacking_bytes,
        "waste_findings": len(report.waste_findings),
    }
    if plan is not None:
        logged["plan_held_bytes"] = plan.held_bytes  # with trim too where the plan was made with it
        logged["plan_checkpointed_modules"] = len(plan.checkpointed)
    elif trimmed:
        # what the audit counts trim's default keeping on this device: every save reclaimable with
        # bit-packing dropped or packed, its masks as bits on the CPU, as bools on a GPU
        from ..planning.chain import held_by_report
        from ..trimming.codec import mask_form

        logged["trimmed_held_bytes"] = held_by_report(report, True, mask_form("auto", report.target))
    if fitted is not None:
        logged["step_peak_bytes"] = fitted.peak_bytes
        logged["step_fits"] = int(fitted.fits)
        if fitted.remedy is not None:
            logged["remedy_step_peak_bytes"] = fitted.remedy.peak_bytes
            logged["remedy_checkpointed_modules"] = len(fitted.remedy.checkpointed)
            logged["remedy_trim"] = int(fitted.remedy.trim)
    return {METRIC_PREFIX + name: value for name, value in logged.items()}


def first_batch(loader: Any) -> Any:
    """The first batch ``loader`` yields, taken so that the run that iterates it next sees exactly what it
    would have seen: every random state the draw may use (torch's, CUDA's, Python's, NumPy's and each
    ``torch.Generator`` the loader and its samplers hold) is put back afterwards, and the iterator is
    closed (worker processes end)."""
    if loader is None:
        raise GradauditError("the trainer has no training dataloader to take the first batch from")
    with randomness_kept(loader):
        iterator = iter(loader)
        try:
            batch = next(iterator)
        except StopIteration:
            raise GradauditError("the training dataloader is empty: there is no batch to audit") from None
        finally:
            close = getattr(iterator, "close", None) or getattr(iterator, "_shutdown_workers", None)
            if close is not None:
                close()
    return batch


def generators_of(loader: Any, depth: int = 4) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a loader draws from: its own and its samplers' (and the samplers
    those wrap), each once."""
    found: list[torch.Generator] = []
    seen: set[int] = set()

    def visit(value: Any, left: int) -> None:
        if value is None or id(value) in seen or left < 0:
            return
        seen.add(id(value))
        if isinstance(value, torch.Generator):
            found.append(value)
            return
        for name in ("generator", "sampler", "batch_sampler", "base_dataloader"):
            visit(getattr(value, name, None), left - 1)

    visit(loader, depth)
    return found


@contextlib.contextmanager
def randomness_kept(loader: Any) -> Iterator[None]:
    generators = [(g, g.get_state()) for g in generators_of(loader)]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        for generator, state in generators:
            generator.set_state(state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(python)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


class TrainingSession:
    """One training run's gradaudit: ``begin`` audits the first batch, writes the reports, checks the
    waste gate and installs trim and/or the plan; ``end`` removes them (the model is as it was)."""

    def __init__(self, options: CallbackOptions) -> None:
        self.options = options
        self.report: Optional[Report] = None
        self.plan: Any = None
        self.fit: Any = None  # with fit_memory: the gradaudit.Fit of the first batch's step
        self._handle: Any = None  # the trim or plan handle installed for the run
        # trim's counts over the run (saves kept, dropped, bit-packed), taken when it is removed
        self.trim_stats: Optional[dict[str, int]] = None

    @property
    def installed(self) -> bool:
        return self._handle is not None and self._handle.installed

    @property
    def trim_handle(self) -> Any:
        """The ``TrimHandle`` in force for the run (installed directly, or by the plan), or None."""
        from ..trimming import TrimHandle

        if isinstance(self._handle, TrimHandle):
            return self._handle
        return getattr(self._handle, "trim_handle", None)

    def begin(self, model: nn.Module, inputs: Any, *, title: str, write: bool = True,
              train_mode: bool = True, optimizer: Any = None) -> dict[str, int]:
        """Audit ``model`` on ``inputs`` (in train mode where ``train_mode``, as a training step runs it; the
        modes are put back), write the reports (where ``write``: one process of several writes them),
        raise on waste when asked, and install trim or the plan; with fit_memory, fit the whole step
        (``optimizer``: the trainer's, else AdamW) and install its remedy where it does not fit. Returns
        the figures to log."""
        if self.installed:
            raise GradauditError("gradaudit's callback is already active on a run: one callback serves one "
                                 "training run at a time")
        with _modes(model, train_mode):
            self.report = report = audit(model, inputs)
            if write and self.options.report is not None:
                self._write(report, title)
            if self.options.fail_on_waste and report.waste_findings:
                raise GradauditError(_waste_message(report, self.options.report if write else None))
            if self.options.plan_budget is not None:
                self.plan = self._plan(model, inputs)
            if self.options.fit_memory is not None:
                self.fit = self._fit(model, inputs, optimizer)
        if self.fit is not None and self.fit.remedy is not None:
            self._handle = self.fit.remedy.apply(model)
        elif self.plan is not None:
            self._handle = self.plan.apply(model)
        elif self.options.trim:
            from ..trimming import trim

            self._handle = trim(model)
        return figures(report, self.plan, self.options.trim, self.fit)

    def end(self) -> None:
        """Remove what ``begin`` installed (nothing else): the model is exactly as before ``begin``."""
        if self._handle is not None:
            trimming = self.trim_handle
            if trimming is not None:
                self.trim_stats = trimming.stats
            self._handle.remove()
            self._handle = None

    def _plan(self, model: nn.Module, inputs: Any) -> Any:
        from ..planning import plan

        if checkpoints_itself(model):
            raise GradauditError("plan_budget replaces the model's own activation checkpointing, which this run turns "
                                 "on: turn it off (Hugging Face: activation_checkpointing=False, formerly "
                                 "gradient_checkpointing, in TrainingArguments) or drop plan_budget")
        # no peak measurement: that would run extra training steps before the run's first
        return plan(model, inputs, self.options.plan_budget, trim=self.options.trim or None,
                    measure_peak=False)

    def _fit(self, model: nn.Module, inputs: Any, optimizer: Any) -> Any:
        from ..fitting import fit
        from ..report.units import human_bytes

        if checkpoints_itself(model):
            raise GradauditError("fit_memory may install a checkpoint plan, which replaces the model's own activation "
                                 "checkpointing, which this run turns on: turn it off or drop fit_memory")
        # what the callback can install is the model's part of a remedy: the trainer's batch stays as it is
        fitted = fit(model, inputs, memory=self.options.fit_memory, optimizer=optimizer, split_batch=False)
        if not fitted.fits and fitted.remedy is None:
            raise GradauditError(f"fit_memory: a training step on the first batch peaks at {human_bytes(fitted.peak_bytes)}, "
                                 f"over {human_bytes(fitted.memory)}, and no trim or checkpoint plan brings it within: "
                                 f"see gradaudit.fit for the breakdown and whether smaller micro-batches with gradient "
                                 f"accumulation fit (a smaller batch, fewer trained parameters)")
        return fitted

    def _write(self, report: Report, title: str) -> None:
        from ..report import html, jsonout

        for path, text in ((self.options.report, html.render(report, title=title)),
                           (self.options.json_report, jsonout.render(report))):
            try:
                path.write_text(text, encoding="utf-8")
            except OSError as error:
                raise GradauditError(f"cannot write the gradaudit report {path}: {error.strerror or error}; "
                                     f"give GradauditCallback(report=...) a writable path") from error


class SessionResults:
    """What both callbacks show of their ``session`` (a TrainingSession) after the first batch."""

    session: TrainingSession

    @property
    def report(self) -> Optional[Report]:
        """The audit's ``gradaudit.Report`` of the first batch (None before it is audited)."""
        return self.session.report

    @property
    def plan(self) -> Any:
        """The ``gradaudit.Plan`` applied for the run (None without ``plan_budget``)."""
        return self.session.plan

    @property
    def fit(self) -> Any:
        """With ``fit_memory``: the ``gradaudit.Fit`` of the first batch's training step (None otherwise)."""
        return self.session.fit

    @property
    def trim_stats(self) -> Optional[dict[str, int]]:
        """trim's counts over the run (saves kept, dropped, bit-packed; None without trim or before the end)."""
        return self.session.trim_stats


@contextlib.contextmanager
def _modes(model: nn.Module, train_mode: bool) -> Iterator[None]:
    """The model in train mode while in force (where ``train_mode``), each module's flag put back."""
    flags = [(m, m.training) for m in model.modules()] if train_mode else []
    try:
        if train_mode:
            model.train()
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def _waste_message(report: Report, path: Optional[Path]) -> str:
    from ..report.units import human_bytes
    from ..report.views import waste_findings_text

    codes = sorted({f.code for f in report.waste_findings})
    where = f"; see {path}" if path is not None else ""
    return (f"fail_on_waste: the first batch's forward holds {human_bytes(report.reclaimable_with_all_fixes_bytes)} "
            f"autograd does not need ({waste_findings_text(report)}: {', '.join(codes)}){where}; "
            f"each finding names its fix (gradaudit explain CODE); trim=True applies the drops and bit-packing "
            f"among them while training")

