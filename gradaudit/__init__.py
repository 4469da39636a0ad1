"""gradaudit: find the memory PyTorch autograd holds for backward that backward can never use.

The package imports torch only when one of its functions is first used: the pytest plugin
(gradaudit.pytest_plugin) is loaded by every pytest run in an environment where gradaudit is
installed, and must not make unrelated test suites import torch.
"""

from typing import Any

from .errors import (ForwardError, GradauditError, LoopChangeWarning, NoMatchingParameterError,
                     NothingRequiresGradError, UnknownCodeError)
from .records import SCHEMA_VERSION, Disagreement, Finding, Report, SavedTensor

__version__ = "0.1.0"

# public name -> (module, attribute); resolved on first access by __getattr__ below
_LAZY = {
    "audit": ("gradaudit.auditing", "audit"),
    "trim": ("gradaudit.trimming", "trim"),
    "TrimHandle": ("gradaudit.trimming", "TrimHandle"),
    "plan": ("gradaudit.planning", "plan"),
    "Plan": ("gradaudit.planning", "Plan"),
    "PlanHandle": ("gradaudit.planning", "PlanHandle"),
    "BudgetError": ("gradaudit.planning", "BudgetError"),
    "assert_no_waste": ("gradaudit.testing", "assert_no_waste"),
    # describing your own autograd.Function (or any node type) to the audit, the proof and trim
    "declare": ("gradaudit.knowledge", "declare"),
    "declare_function": ("gradaudit.knowledge", "declare_function"),
    "Read": ("gradaudit.knowledge", "Read"),
    "Reads": ("gradaudit.knowledge", "Reads"),
    "Bit": ("gradaudit.knowledge", "Bit"),
    # build a model (and its batch) on meta with the values that can be known kept
    "meta_device": ("gradaudit.values", "meta_device"),
    # will a whole training step fit, and the cheapest change that makes it
    "fit": ("gradaudit.fitting", "fit"),
    "Fit": ("gradaudit.fitting", "Fit"),
    # per rank: FSDP2, tensor and sequence parallel models in a fake process group on this machine
    "fake_world": ("gradaudit.ranks", "fake_world"),
    "per_rank": ("gradaudit.ranks", "per_rank"),
    # which GPU, torch release and cuDNN target="cuda" stands for
    "assume_gpu": ("gradaudit.cuda_choices", "assume_gpu"),
    # a call's positional and keyword arguments together: gradaudit.Args(batch, target=labels)
    "Args": ("gradaudit.tensors", "Args"),
}

__all__ = [
    "audit", "trim", "TrimHandle", "plan", "Plan", "PlanHandle", "BudgetError", "assert_no_waste", "declare", "declare_function", "Read", "Reads", "Bit",
    "meta_device", "fit", "Fit", "fake_world", "per_rank", "assume_gpu", "Args", "Report", "Finding", "SavedTensor", "Disagreement", "SCHEMA_VERSION",
    "GradauditError", "ForwardError", "NothingRequiresGradError", "UnknownCodeError", "NoMatchingParameterError",
    "LoopChangeWarning",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attribute)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'gradaudit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
