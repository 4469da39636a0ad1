"""Every private PyTorch API gradaudit uses, behind one door, one room per subject.

Nothing outside this package names a private torch attribute or module. Each feature is looked up
once, when the package is imported; a missing one becomes a ``GradauditError`` that names the
feature, the installed torch and what to do, raised where a caller needs it (``require``), never an
AttributeError deep inside a hook. Enum values are taken by name, and hooks are recognised by
identity (a code object), not by a substring of a name.

The rooms (each imported by the modules that need its subject):

- ``features``: the feature table (``FEATURES``, ``has``) and ``require``.

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

from .features import FEATURES, SINCE, has, require  # noqa: F401

# each room adds the features it looks up to FEATURES
from . import (autograd, checkpoint, compiler, dispatch, distributed, fsdp, kernels,  # noqa: E402,F401
               modules, optimizers, storages)
