"""``torch.compile``: compiled modules and their eager originals, tracing, running eagerly."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .features import require


COMPILED_NODE = "CompiledFunctionBackward"  # one node per compiled region in the autograd graph


def compiled_original(module: Any) -> Optional[torch.nn.Module]:
    """The eager module behind a ``torch.compile``'d one (``OptimizedModule._orig_mod``), else None.
    Recognised without importing torch._dynamo (importing it is slow)."""
    if type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None),
                                                                 torch.nn.Module):
        return module._orig_mod
    return None


_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def compiling() -> bool:
    """Whether TorchDynamo is tracing the code that calls this (it folds the answer into the graph:
    a hook can skip what dynamo cannot trace without breaking the graph)."""
    return _IS_COMPILING()


def force_eager(who: str) -> Any:
    """A context in which torch.compile'd modules and functions run eagerly."""
    require("compiler stance", who)
    return torch.compiler.set_stance("force_eager")
