"""Every private PyTorch API gradaudit uses, behind one door, one room per subject.

Nothing outside this package names a private torch attribute or module. Each feature is looked up
once, when the package is imported; a missing one becomes a ``GradauditError`` that names the
feature, the installed torch and what to do, raised where a caller needs it (``require``), never an
AttributeError deep inside a hook. Enum values are taken by name, and hooks are recognised by
identity (a code object), not by a substring of a name.

The rooms (each imported by the modules that need its subject):

- ``autograd``: autograd nodes (saved slots, sequence numbers, the node-creation hook) and
  saved-tensor hooks (whose they are: a checkpoint's, ``save_on_cpu``'s, anybody's).
- ``checkpoint``: ``torch.utils.checkpoint``'s internals (the frames that save a region's inputs,
  selective checkpointing's cache, turning a model's own checkpointing off).
- ``compiler``: ``torch.compile`` (compiled modules, tracing, running eagerly).
- ``dispatch``: dispatch and function modes, operator overloads and schemas, pytrees.
- ``distributed`` and ``fsdp``: DTensors, collectives and ranks; FSDP2's gathered parameters.
- ``kernels``: attention backends and their settings, CUDA's kernels called on meta tensors,
  cuDNN, autocast.
- ``modules``: ``nn.Module``'s own dictionaries and forward hooks, the batch-norm base classes.
- ``optimizers``: torch.optim's fused implementations on meta.
- ``storages``: storage identity, weak references to storages, version counters, views.

Tested on torch 2.11, 2.14 and 2.15 (CI runs the suite on each); tests/test_torchapi.py pins each feature.
"""

from __future__ import annotations

import torch

from ..errors import GradauditError

_AUTOGRAD = torch._C._autograd


FEATURES: dict[str, bool] = {
    # a callback for every autograd node as it is created (gradaudit.trim; the recorder's sites)
    "node creation hook": hasattr(_AUTOGRAD, "_push_node_creation_hook")
    and hasattr(_AUTOGRAD, "_pop_node_creation_hook"),
    "sequence numbers": hasattr(_AUTOGRAD, "_get_sequence_nr"),
    "graph task id": hasattr(torch._C, "_current_graph_task_id"),
    "saved-tensor hook state": hasattr(_AUTOGRAD, "_saved_tensors_hooks_is_enabled")
    and hasattr(_AUTOGRAD, "_top_saved_tensors_default_hooks"),
    "SDPA kernel choice": hasattr(torch, "_fused_sdp_choice"),
    # torch.compiler.set_stance("force_eager"): run torch.compile'd code eagerly
    "compiler stance": hasattr(getattr(torch, "compiler", None), "set_stance"),
}


def has(feature: str) -> bool:
    return FEATURES[feature]


# the first torch release with each feature, for the error message
SINCE = {"node creation hook": "2.14"}


def require(feature: str, who: str) -> None:
    """Raise a GradauditError when ``feature`` is missing from the installed torch."""
    if not FEATURES[feature]:
        since = f" (torch >= {SINCE[feature]})" if feature in SINCE else ""
        raise GradauditError(f"{who} needs PyTorch's {feature}{since}, which torch {torch.__version__} does not "
                             f"have; upgrade torch to use it (audits work without it)")


# each room adds the features it looks up to FEATURES
from . import (autograd, checkpoint, compiler, dispatch, distributed, fsdp, kernels,  # noqa: E402,F401
               modules, optimizers, storages)
