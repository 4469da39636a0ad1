"""Which module is running: a stack of the module paths whose forward is running, kept by forward
hooks (the recorder's sites, trim's module boundaries).
"""

from __future__ import annotations

import bisect
from typing import Any, Optional, Sequence

from torch import nn

from .torchapi.autograd import sequence_number
from .torchapi.compiler import compiling, original_path
from .torchapi.modules import add_forward_hooks, remove_forward_hooks


class ModuleTracker:
    """Keeps a stack of the module paths whose forward is running, via per-module forward hooks.

    ``on_boundary``: called as every submodule's forward starts (with its arguments) and ends (with
    its output), before the stack changes (``trim`` decides the nodes created since the last
    boundary there; without torch's node-creation hook it finds them from these tensors).
    ``on_enter``: called with the (path, class) of every submodule whose forward starts, before it
    is pushed (the recorder notes which modules run inside a checkpoint).
    """

    def __init__(self, model: nn.Module, on_boundary: Optional[Any] = None, on_enter: Optional[Any] = None,
                 modules: Optional[Sequence[tuple[str, nn.Module]]] = None) -> None:
        self.model = model
        self.stack: list[tuple[str, str]] = [("", type(model).__name__)]
        self.on_boundary = on_boundary
        self.on_enter = on_enter
        self._handles: list[Any] = []
        # (sequence number of the next autograd node, the module running from then on) at every
        # change of the running module, when a list is set: which module made a node, where torch
        # has no node-creation hook to tell (torch 2.11 to 2.13; the recorder sets it there)
        self.timeline: Optional[list[tuple[int, tuple[str, str]]]] = None
        # ``list(model.named_modules())`` when the caller has it (taken again on entry otherwise)
        self._named_modules = modules

    def __enter__(self) -> "ModuleTracker":
        modules = self._named_modules if self._named_modules is not None else self.model.named_modules()
        post, add = self._post, add_forward_hooks
        for path, module in modules:
            if module is self.model:
                continue
            # a compiled model's modules by the eager model's paths ("_orig_mod." left out), as its
            # compiled regions' saves are named
            self._handles.append(add(module, self._make_pre((original_path(path), type(module).__name__)), post))
        return self

    def _make_pre(self, entry: tuple[str, str]):
        stack, boundary, enter = self.stack, self.on_boundary, self.on_enter

        if enter is not None:
            def pre(module: nn.Module, args: Any) -> None:
                if boundary is not None:
                    boundary(args)
                enter(entry)
                stack.append(entry)
                if self.timeline is not None and not compiling():
                    self.timeline.append((sequence_number(), entry))
        elif boundary is None:
            def pre(module: nn.Module, args: Any) -> None:
                stack.append(entry)
                if self.timeline is not None and not compiling():
                    self.timeline.append((sequence_number(), entry))
        else:
            def pre(module: nn.Module, args: Any) -> None:
                boundary(args)
                stack.append(entry)

        return pre

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.on_boundary is not None:
            self.on_boundary(output)
        if len(self.stack) > 1:
            self.stack.pop()
            if self.timeline is not None and not compiling():
                self.timeline.append((sequence_number(), self.stack[-1]))

    def reset(self) -> None:
        """Back to the root module alone (a forward that raised may leave entries behind)."""
        del self.stack[1:]

    def running_at(self, sequence: int) -> tuple[str, str]:
        """(path, class) of the module that was running when the node numbered ``sequence`` was made,
        from ``timeline`` (the root where the timeline has nothing before it)."""
        timeline = self.timeline or []
        k = bisect.bisect_right(timeline, sequence, key=lambda change: change[0])
        return timeline[k - 1][1] if k else self.stack[0]

    def __exit__(self, *exc: Any) -> None:
        remove = remove_forward_hooks
        for added in self._handles:
            remove(added)
        self._handles.clear()
