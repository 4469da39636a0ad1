"""The user's optimizer, run on stand-ins: the ``optimizer=`` argument (a ``torch.optim`` class or
its name, an instance, a ``module:Class`` name, or any callable from parameters to an optimizer)
resolved to a builder, and that builder run over meta tensors shaped like the parameters that train.
Its state and its step's temporaries are then what the optimizer itself allocates, for any optimizer,
not a table of multipliers.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from ..errors import GradauditError

DEFAULT = "adamw"


def resolve(optimizer: Any) -> tuple[Callable[[Any], torch.optim.Optimizer], str]:
    """(a builder taking what an optimizer's constructor takes, a name for reports). An instance is
    rebuilt over the stand-ins of its own parameters, with its groups' options."""
    if optimizer is None:
        optimizer = DEFAULT
    if isinstance(optimizer, str):
        return _named(optimizer), optimizer
    # a trainer's wrapper (accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer) around the real one
    inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    if isinstance(optimizer, torch.optim.Optimizer):
        return _like(optimizer), type(optimizer).__name__
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer, optimizer.__name__
    if callable(optimizer):
        return optimizer, getattr(optimizer, "__name__", None) or getattr(getattr(optimizer, "func", None), "__name__",
                                                                         type(optimizer).__name__)
    raise GradauditError(f"optimizer must be a torch.optim class, an instance, a name such as 'adamw' or a callable "
                         f"from parameters to an optimizer, not {optimizer!r}")


# torch.optim optimizers whose step fit cannot run: why
UNSUPPORTED = {"lbfgs": "LBFGS steps with a closure that reruns the forward and backward, which fit does not model"}


def names() -> list[str]:
    """The torch.optim optimizers a name may give, lower case (those fit can step)."""
    return sorted(name.lower() for name, value in vars(torch.optim).items()
                  if isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
                  and value is not torch.optim.Optimizer and name.lower() not in UNSUPPORTED)


def _named(name: str) -> Any:
    if ":" in name:
        from ..loading import load_object

        value = load_object(name)
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) or callable(value):
            return value
        raise GradauditError(f"{name} is not an optimizer class or a callable building one")
    found = {n.lower(): value for n, value in vars(torch.optim).items()
             if isinstance(value, type) and issubclass(value, torch.optim.Optimizer)}
    if name.lower() in UNSUPPORTED:
        raise GradauditError(f"optimizer {name!r}: {UNSUPPORTED[name.lower()]}; use one of {', '.join(names())}")
    if name.lower() not in found or name.lower() == "optimizer":
        raise GradauditError(f"unknown optimizer {name!r}: use one of {', '.join(names())}, or module:Class")
    return found[name.lower()]


def _like(instance: torch.optim.Optimizer) -> Callable[[Any], torch.optim.Optimizer]:
    """A builder of ``instance``'s class with its constructor's defaults; ``instance_groups`` gives it
    the instance's groups."""
    cls = type(instance)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in instance.defaults.items() if k in accepted and k != "params"}

    def build(groups: Any) -> torch.optim.Optimizer:
        return cls(groups, **defaults)

    build.instance = instance  # type: ignore[attr-defined]
    return build


def stand_in_groups(builder: Any, trains: Sequence[torch.Tensor], stand_in: dict[int, torch.Tensor]) -> Any:
    """What the builder is given: an instance's own groups (its parameters as stand-ins, those it
    does not hold as stand-ins ignored), else the stand-ins of the parameters that train."""
    instance = getattr(builder, "instance", None)
    if instance is None:
        return [stand_in[id(p)] for p in trains]
    groups = []
    for group in instance.param_groups:
        options = {k: v for k, v in group.items() if k != "params"}
        groups.append({**options, "params": [stand_in[id(p)] for p in group["params"] if id(p) in stand_in]})
    return groups


def target_defaults(optimizer: torch.optim.Optimizer, target: str) -> list[str]:
    """Make the stand-in take the implementation the optimizer would take on ``target``'s tensors
    where it is left to choose (``foreach=None``): on CUDA the foreach one (the stand-ins are meta
    tensors, for which torch would choose the loop). Returns notes."""
    if target != "cuda":
        return []
    chosen = 0
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = True
            chosen += 1
    return ["the optimizer runs its foreach implementation, as torch chooses by default for CUDA tensors; "
            "to fit the per-parameter loop give an optimizer built with foreach=False (Python: "
            "optimizer=functools.partial(torch.optim.AdamW, foreach=False); the CLI: --optimizer file.py:make, "
            "make(params) returning it)"] if chosen else []


def build(builder: Any, groups: Any, name: str) -> torch.optim.Optimizer:
    """The stand-in optimizer, or a GradauditError saying why it could not be built."""
    try:
        optimizer = builder(groups)
    except GradauditError:
        raise
    except Exception as error:
        raise GradauditError(f"could not build the optimizer {name} over meta stand-ins of the parameters: "
                             f"{type(error).__name__}: {error}. Pass a callable building it from the parameters "
                             f"(optimizer=lambda params: MyOptimizer(params, ...))") from error
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise GradauditError(f"the optimizer builder {name} returned {type(optimizer).__name__}, not a "
                             f"torch.optim.Optimizer")
    return optimizer


def step(optimizer: torch.optim.Optimizer, name: str) -> None:
    """One optimizer step, or a GradauditError saying why it could not run on stand-ins."""
    try:
        optimizer.step()
    except Exception as error:
        fused = any(group.get("fused") for group in optimizer.param_groups)
        if "closure" in str(error):
            advice = "Optimizers that need a closure (LBFGS) are not supported"
        elif fused:
            advice = "torch has no meta kernel for this fused optimizer: fit it with foreach=True instead"
        else:
            advice = "An optimizer that reads parameter values (.item()) cannot be fitted on meta"
        raise GradauditError(f"the optimizer {name} could not step on meta stand-ins: "
                             f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}. "
                             f"{advice}") from error
