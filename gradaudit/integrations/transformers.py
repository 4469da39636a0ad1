"""``GradauditCallback`` for Hugging Face's ``transformers.Trainer`` (and trainers built on it, such as TRL's).

    from gradaudit.integrations.transformers import GradauditCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
                      callbacks=[GradauditCallback(trim=True)])

At ``on_train_begin`` it takes the first batch of the Trainer's own train dataloader (its collator, padding
and labels; the random states the draw used are put back, so training sees the same batches), audits the
model on it as the Trainer's step runs it (train mode; the Trainer's autocast, which accelerate puts on the
model's forward, and its gradient checkpointing, which it turned on before this event), writes the HTML and
JSON reports, and logs the figures (``gradaudit/held_bytes`` ...) as ``Trainer.log`` does: into
``state.log_history`` and to every callback's ``on_log`` (W&B, TensorBoard, ...). Then it installs
``gradaudit.trim`` and/or the plan for ``plan_budget`` on the model for the run; ``on_train_end`` removes them.

What the audit leaves out: a ``num_items_in_batch`` the Trainer passes to the forward of models that take
loss keyword arguments (it changes no saved tensor but a scalar), and a custom ``compute_loss``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import Any, Optional, Union

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from ..errors import GradauditError
from ..loading import to_device
from .session import CallbackOptions, SessionResults, TrainingSession, first_batch

__all__ = ["GradauditCallback"]


class GradauditCallback(SessionResults, TrainerCallback):
    """Audit the first training batch, report and log it, and trim and/or plan the model for the run.

    report: the HTML report's path (the JSON report is written beside it, ``.json``); None writes neither.
    trim: install ``gradaudit.trim`` for the run (gradients stay bit-identical).
    plan_budget: bytes (an int, or a size such as ``"8GiB"``) autograd may hold after each forward: the
        plan ``gradaudit.plan`` chooses for that budget is applied for the run (with trim, on top of it).
        Replaces the Trainer's own gradient checkpointing, which must be off.
    fail_on_waste: raise ``GradauditError`` before the first step when the first batch's forward holds
        memory autograd does not need (waste findings).
    fit_memory: bytes (or a size such as ``"24GiB"``) one training step may use: the whole step on the first
        batch is fitted with the Trainer's optimizer (``gradaudit.fit``) and its predicted peak logged; where
        it does not fit, the cheapest remedy (trim and/or a checkpoint plan) is installed for the run, and
        where none makes it fit, ``GradauditError`` is raised before the first step. It chooses trim and the
        plan itself: not with ``trim`` or ``plan_budget``.
    """

    def __init__(self, report: Optional[str] = "gradaudit-report.html", trim: bool = False,
                 plan_budget: Union[int, str, None] = None, fail_on_waste: bool = False,
                 fit_memory: Union[int, str, None] = None) -> None:
        self.options = CallbackOptions.checked(report, trim, plan_budget, fail_on_waste, fit_memory)
        self.session = TrainingSession(self.options)
        self.figures: dict[str, int] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, train_dataloader: Any = None,
                       **kwargs: Any) -> Any:
        handler = _calling_handler(self)  # first: the frame that called us is the handler's
        if model is None:
            raise GradauditError("GradauditCallback.on_train_begin got no model: add the callback to a "
                                 "transformers.Trainer (callbacks=[GradauditCallback()])")
        # accelerate's DataLoaderShard registers itself with the accelerator's gradient state when iterated
        # and unregisters only at its end: the torch DataLoader it wraps gives the same first batch (moved to
        # the model's device here, as the shard would) and leaves that state alone
        loader = getattr(train_dataloader, "base_dataloader", train_dataloader)
        batch = _as_forward_inputs(first_batch(loader), model)
        self.figures = self.session.begin(model, batch, write=state.is_world_process_zero,
                                          optimizer=kwargs.get("optimizer"),
                                          title=f"gradaudit: {type(model).__name__} (Trainer, first batch)")
        # as Trainer.log does it: the history, then every callback's on_log (the reporting integrations)
        logs: dict[str, Any] = dict(self.figures)
        state.log_history.append({**logs, "step": state.global_step})
        if handler is None:
            warnings.warn("GradauditCallback.on_train_begin was not called by a Trainer's CallbackHandler: its figures "
                          "are in state.log_history only, not sent to the reporting integrations", stacklevel=2)
            return control
        return handler.on_log(args, state, control, logs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.remove()
        return control

    def remove(self) -> None:
        """Take trim and the plan off the model (``on_train_end`` does; the Trainer calls no callback when
        training raises, so call this in your ``except``/``finally`` to get the model back as it was)."""
        self.session.end()


def _as_forward_inputs(batch: Any, model: Any) -> Any:
    """The batch as ``Trainer.training_step`` gives it to the model: on the model's device, a mapping as
    keyword arguments (``model(**inputs)``)."""
    if not isinstance(batch, Mapping):
        raise GradauditError(f"the Trainer's collator gave a {type(batch).__name__}; the Trainer calls "
                             f"model(**batch), so its batches are mappings of argument names to tensors")
    first = next(model.parameters(), None)
    device = str(first.device) if first is not None else "cpu"
    return to_device(dict(batch), device)


def _calling_handler(callback: GradauditCallback) -> Optional[CallbackHandler]:
    """The Trainer's CallbackHandler dispatching this event, which the event's arguments do not include: it
    is what calls ``on_log`` on the reporting integrations. None when the event was called otherwise."""
    frame = sys._getframe(2)  # 0: here, 1: on_train_begin, 2: CallbackHandler.call_event
    handler = frame.f_locals.get("self") if frame is not None else None
    if isinstance(handler, CallbackHandler) and any(cb is callback for cb in handler.callbacks):
        return handler
    return None
