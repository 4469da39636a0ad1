"""The model's own switches a plan turns: ``gradaudit.trim`` installed or not (``trim_options``,
``trimmed``), a Hugging Face model's key/value cache (``cache_off``), and its own checkpointing,
which the plan replaces (``checkpointed_now``, ``own_checkpointing_off``). How a run is set up
otherwise (the what-if, the target, the state restored) is ``gradaudit.conditions``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

from torch import nn

from ..conditions import device_type_of, trimmed_now
from ..errors import GradauditError
from ..recorder import CHECKPOINT_INPUTS
from ..records import Manager
from ..torchapi.checkpoint import REENTRANT_CHECKPOINT_NODE, checkpointing_off


def cache_config(model: nn.Module) -> Any:
    """The Hugging Face config of ``model`` when it asks the forward for a key/value cache
    (``use_cache=True``, the default of most decoders), else None."""
    config = getattr(model, "config", None)
    return config if getattr(config, "use_cache", None) is True else None


CACHE_NOTE = ("the model's config has use_cache=True: it is planned, and a plan applied, with the cache off, as "
              "Hugging Face's own gradient checkpointing trains (a checkpointed block cannot be passed a cache, "
              "and training never reads it)")


@contextlib.contextmanager
def cache_off(model: nn.Module) -> Iterator[bool]:
    """``use_cache`` set to False on the model's Hugging Face config while in force; yields whether it
    was on."""
    config = cache_config(model)
    if config is None:
        yield False
        return
    config.use_cache = False
    try:
        yield True
    finally:
        config.use_cache = True


def checkpoints_itself(model: nn.Module) -> bool:
    """Whether a Hugging Face model has its own activation checkpointing on (transformers 5 renamed
    ``is_gradient_checkpointing``, which now warns, to ``is_activation_checkpointing``)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def checkpointing_off_call(model: nn.Module) -> str:
    """How to turn a Hugging Face model's own checkpointing off with the installed transformers:
    ``activation_checkpointing_disable`` where it exists (transformers 5 deprecates the
    ``gradient_checkpointing_*`` names), else the old name."""
    for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
        if hasattr(type(model), name):
            return f"model.{name}()"
    return "model.activation_checkpointing_disable()"


def checkpointed_now(report: Any) -> list[str]:
    """The modules the audited forward checkpointed itself (torch.utils.checkpoint regions)."""
    regions = {n.module or "the model" for n in report.nodes
               if n.name in (CHECKPOINT_INPUTS, REENTRANT_CHECKPOINT_NODE)}
    if not regions and any(t.managed_by == Manager.CHECKPOINT for t in report.tensors):
        regions.add("the model")
    return sorted(regions)


def own_checkpointing_off(now: Sequence[str]) -> Any:
    """The model's own checkpointing turned off while in force, where it has some (``now``:
    ``checkpointed_now``): the planner's runs measure the model as the plan would leave it."""
    return checkpointing_off() if now else contextlib.nullcontext()


@contextlib.contextmanager
def trimmed(model: nn.Module, bitpack: Optional[bool], masks: str = "bits") -> Iterator[None]:
    """gradaudit.trim installed (with ``bitpack`` and ``masks``) while in force, unless it is already or
    ``bitpack`` is None (a plan without trim)."""
    if bitpack is None or trimmed_now(model):
        yield
        return
    from ..trimming import trim as install_trim

    with install_trim(model, bitpack=bitpack, masks=masks):
        yield


def trim_options(model: nn.Module, trim: Optional[bool], bitpack: Optional[bool],
                 masks: Optional[str] = None, target: str = "cpu") -> tuple[Any, Optional[bool], str]:
    """(the trim handle installed on ``model`` or None, the plan's bitpack: None for a plan without
    trim, the form of its masks: "bits" or "bytes", what trim's ``masks`` option makes of them on the
    device type ``target`` the plan is for, or for an installed trim on the device its model is on).
    Every combination that would make the figures wrong for the model is refused."""
    from ..trimming.codec import MASK_FORMATS, mask_form

    for name, value in (("trim", trim), ("bitpack", bitpack)):
        if value is not None and not isinstance(value, bool):
            raise GradauditError(f"{name} must be True, False or None, not {value!r}")
    if masks is not None and masks not in MASK_FORMATS:
        raise GradauditError(f"masks={masks!r}: choose one of {', '.join(map(repr, MASK_FORMATS))}")
    installed = None
    if trimmed_now(model):
        from ..trimming.handle import handle_of

        installed = handle_of(model)
    if trim is None:
        trim = installed is not None
    if not trim:
        if installed is not None:
            raise GradauditError("gradaudit.trim is installed on this model, so it holds less than a plan without "
                                 "trim says: plan with trim=True (--trim), or remove the trim handle first")
        for name, value in (("bitpack", bitpack), ("masks", masks)):
            if value is not None:
                raise GradauditError(f"{name}={value!r} is an option of trim: pass trim=True with it (--trim)")
        return None, None, "bits"
    if installed is not None:
        # what the installed trim does where it runs: its model's device
        form = installed.masks_on(device_type_of(model, target))
        asked = None if masks is None else mask_form(masks, target, installed.kernels)
        for name, value, theirs in (("bitpack", bitpack, installed.bitpack), ("masks", asked, form)):
            if value is not None and value != theirs:
                raise GradauditError(f"gradaudit.trim is installed on this model with {name}={theirs!r}: plan with "
                                     f"{name}={theirs!r}, or remove the trim handle first")
        return installed, installed.bitpack, form
    return None, True if bitpack is None else bitpack, mask_form(masks or "auto", target)
