"""Which modules a plan may checkpoint: the repeated blocks of a model (``repeated_blocks``), or the
modules the caller's glob patterns name (``candidates``).
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from typing import Optional, Sequence

from torch import nn

from ..errors import GradauditError


NO_BLOCKS = "no repeated blocks found (children of an nn.ModuleList or nn.Sequential that share a class)"
NAME_BLOCKS = NO_BLOCKS + ": name the modules to consider with blocks=[GLOB, ...] (--blocks GLOB)"


def repeated_blocks(model: nn.Module) -> list[str]:
    """The modules a plan checkpoints by default: the children of every ``nn.ModuleList`` or
    ``nn.Sequential`` with two or more children of one class (transformer layers, ResNet stages'
    blocks, the layers of a sequential stack), the outermost such container on each branch."""
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = list(module.named_children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and children:
            if max(Counter(type(c) for _, c in children).values()) >= 2:
                found.extend(f"{prefix}{name}" for name, _ in children)
                return
        for name, child in children:
            visit(f"{prefix}{name}.", child)

    visit("", model)
    return found


def candidates(model: nn.Module, blocks: Optional[Sequence[str]]) -> list[str]:
    """The module paths ``blocks`` (glob patterns; None: ``repeated_blocks``) names, the outermost of
    nested matches. A model with neither: see ``called_repeatedly``."""
    if blocks is None:
        paths = repeated_blocks(model)
        if not paths:
            raise GradauditError(NAME_BLOCKS)
        return paths
    if isinstance(blocks, str):
        blocks = [blocks]
    names = [path for path, _ in model.named_modules() if path]
    paths = []
    for pattern in blocks:
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise GradauditError(f"blocks: {pattern!r} matches no module (names as in named_modules(), "
                                 f"e.g. {names[0]!r})" if names else "blocks: the model has no submodules")
        paths.extend(matched)
    # the outermost of nested matches: checkpointing a module already recomputes what is inside
    paths = sorted(set(paths))
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]


def called_repeatedly(calls: Sequence[str]) -> tuple[list[str], str]:
    """The candidates of a model without repeated blocks, from its module calls in one forward (their
    paths, in order): the outermost modules called several times (one layer applied N times, its
    weights shared, as ALBERT does), each a block whose checkpoint recomputes all its calls or none,
    and the note that says so. None called repeatedly: GradauditError, asking for ``blocks``."""
    counts = Counter(calls)
    repeated = [path for path in counts if counts[path] >= 2 and path]
    outer = [p for p in repeated if not any(inside(p, q) for q in repeated if q != p)]
    if not outer:
        raise GradauditError(NAME_BLOCKS)
    runs = ", ".join(f"{p} runs {counts[p]} times" for p in outer)
    return outer, (f"{NO_BLOCKS}; planned instead: the modules the forward calls repeatedly ({runs}), each one block "
                   f"whose checkpoint recomputes all its calls or none (its weights shared: one layer applied N "
                   f"times); name others with blocks=[GLOB, ...]")


def inside(path: str, block: str) -> bool:
    """Whether the module ``path`` is the block ``block`` or inside it."""
    return path == block or path.startswith(block + ".")
