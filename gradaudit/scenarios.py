"""The selective-differentiation settings the memsave study measured, as one function.

Used by the trim benchmark and tests, and handy for what-if audits of your own model:

    apply_scenario(model, "input-only-bn-eval", x); report = gradaudit.audit(model, x)

It changes the model's flags (train/eval, requires_grad) and the input's requires_grad in place.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import GradauditError
from .torchapi.modules import BATCH_NORM_BASE

class ScenarioError(GradauditError, ValueError):
    """An unknown scenario name."""


SCENARIOS = ("all-trainable", "input-only", "input-only-bn-eval", "norm-only", "surgical")
NORMS = (BATCH_NORM_BASE, nn.LayerNorm, nn.GroupNorm)


def apply_scenario(model: nn.Module, scenario: str, inputs: torch.Tensor) -> None:
    """all-trainable / input-only / input-only-bn-eval / norm-only / surgical (the first third of
    the layers with weights trainable, as in surgical fine-tuning)."""
    if scenario not in SCENARIOS:
        raise ScenarioError(f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}")
    model.train(scenario != "input-only-bn-eval")
    model.requires_grad_(scenario == "all-trainable")
    inputs.requires_grad_(scenario.startswith("input-only"))
    if scenario == "norm-only":
        for module in model.modules():
            if isinstance(module, NORMS):
                module.requires_grad_(True)
    if scenario == "surgical":
        layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear, *NORMS))]
        for module in layers[: max(1, len(layers) // 3)]:
            module.requires_grad_(True)
