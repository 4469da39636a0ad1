"""The features of the installed torch that gradaudit looks up (``FEATURES``, filled in by each room
of ``gradaudit.torchapi`` as it is imported) and ``require``, the error that names a missing one."""

from __future__ import annotations

import torch

from ..errors import GradauditError

AUTOGRAD = torch._C._autograd  # the autograd engine's bindings


FEATURES: dict[str, bool] = {
    # a callback for every autograd node as it is created (gradaudit.trim; the recorder's sites)
    "node creation hook": hasattr(AUTOGRAD, "_push_node_creation_hook")
    and hasattr(AUTOGRAD, "_pop_node_creation_hook"),
    "sequence numbers": hasattr(AUTOGRAD, "_get_sequence_nr"),
    # hooks given to one saved tensor of a built node (trim's steady plan)
    "saved tensor hooks per save": hasattr(getattr(AUTOGRAD, "SavedTensor", None), "register_hooks"),
    "graph task id": hasattr(torch._C, "_current_graph_task_id"),
    "saved-tensor hook state": hasattr(AUTOGRAD, "_saved_tensors_hooks_is_enabled")
    and hasattr(AUTOGRAD, "_top_saved_tensors_default_hooks"),
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
