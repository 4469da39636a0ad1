"""Op knowledge: one declaration per autograd node type says what its backward reads.

Importing this package declares PyTorch's own nodes (``builtin``) and the custom Functions of
popular libraries (``libraries``: BLOOM's GELU, torchvision's roi_align), by node name. Describe your own
``torch.autograd.Function`` with ``declare_function`` (or ``declare`` for any node name); the
audit, ``verify=True``'s hints and ``gradaudit.trim`` then use it like the built-in knowledge.
"""

from . import builtin  # noqa: F401  (declares torch's nodes on import)
from . import libraries  # noqa: F401  (declares popular libraries' custom Functions by node name)
from . import registry  # noqa: F401  (the module, for tests that swap declarations)
from .registry import (Bit, Declaration, Outcome, Read, Reads, declaration, declarations, declare, hidden_by,
                      declare_function, declared_ops, scalars_read, weight_slot, weight_slots)

__all__ = ["Bit", "Declaration", "Outcome", "Read", "Reads", "declaration", "declarations", "declare", "hidden_by",
           "declare_function", "declared_ops", "scalars_read", "weight_slot", "weight_slots"]
