"""Where in the user's code: the source line behind a tensor (the innermost frame outside torch,
gradaudit and the packages that drive code) and the line that constructed a module.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import weakref
from typing import Any, Iterator, Optional

import torch
from torch import nn

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(__file__) + os.sep
_internal_cache: dict[str, bool] = {}
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
_LIBRARY_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
# Installed packages that run other people's code: a frame of theirs never explains a tensor. Model
# libraries (transformers, torchvision, timm, ...) are not here: their frames are where the op is written.
DRIVER_PACKAGES = frozenset({
    "click", "typer", "pluggy", "_pytest", "pytest", "py", "IPython", "ipykernel", "debugpy",
    "_pydevd_bundle", "_pydev_bundle", "pydevd", "coverage", "hypothesis", "tornado", "zmq", "traitlets",
    "nbclient", "jupyter_client", "jupyter_core", "anyio", "runpy", "importlib_metadata",
})


def _within_library(filename: str) -> Optional[str]:
    """An installed file's path inside site-packages (or dist-packages), else None."""
    for marker in _LIBRARY_DIRS:
        if marker in filename:
            return filename.split(marker, 1)[1]
    return None


def _library_of(filename: str) -> Optional[str]:
    """The top-level package (or module) an installed file belongs to, else None."""
    within = _within_library(filename)
    if within is None:
        return None
    first = within.split(os.sep, 1)[0]
    return first[:-3] if first.endswith(".py") else first


def _is_internal(code: Any) -> bool:
    """A frame that never explains a tensor: torch, gradaudit, the standard library (runpy, importlib,
    contextlib, ...) and installed packages that drive code (click, pytest, IPython, ...)."""
    return _internal_file(code.co_filename)  # by file: equal code objects of two files compare equal


def _internal_file(name: str) -> bool:
    hit = _internal_cache.get(name)
    if hit is None:
        library = _library_of(name)
        hit = (name.startswith(_TORCH_DIR) or name.startswith(_PACKAGE_DIR) or name.startswith("<frozen")
               or (library is None and name.startswith(_STDLIB_DIR)) or library in DRIVER_PACKAGES)
        _internal_cache[name] = hit
    return hit


def short_path(filename: str, cwd: Optional[str] = None) -> str:
    """A path readable and stable across machines: a file of an installed package by the package's
    own path (``torchvision/models/resnet.py``, wherever site-packages is, a virtual environment inside
    the project included); any other file relative to cwd when under it, else as given.

    ``cwd``: the working directory to take it relative to (default: the current one).
    """
    if not os.path.isabs(filename):
        return filename
    within = _within_library(filename)
    if within is not None:
        return within
    cwd = (os.getcwd() if cwd is None else cwd) + os.sep
    if filename.startswith(cwd):
        return filename[len(cwd):]
    return filename


def user_source_line(frame: Any = None, stop: Any = None) -> Optional[str]:
    """``file:line`` of the innermost frame outside torch, gradaudit and driver code (from ``frame``
    outwards; default: the caller's), or None.

    ``stop``: the frame that called the model's forward (``audit()``'s). The walk ends there: a line
    at or outside it is where the forward was *called* (the ``audit(...)`` line, a test, click), which
    says nothing about the tensor; the model's own code is only what runs inside the call.
    """
    if frame is None:
        frame = sys._getframe(1)
    frame = user_frame(frame, stop)
    return None if frame is None else f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"


_TRACE_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)', re.MULTILINE)


def traced_source_line(trace: str) -> Optional[str]:
    """``file:line`` of the innermost frame outside torch, gradaudit and driver code in a stack trace
    as Python's traceback prints it (the ``stack_trace`` torch.compile's graphs record per op), or
    None."""
    for filename, line in reversed(_TRACE_FRAME.findall(trace)):
        if not _internal_file(filename):
            return f"{short_path(filename)}:{line}"
    return None


def user_frame(frame: Any, stop: Any) -> Any:
    """The innermost frame from ``frame`` outwards, before ``stop``, that ``_is_internal`` does not
    rule out; None if there is none (``user_source_line``'s walk, run for every node recorded)."""
    known = _internal_cache
    while frame is not None and frame is not stop:
        code = frame.f_code
        internal = known.get(code.co_filename)
        if internal is None:
            internal = _is_internal(code)
        if not internal:
            return frame
        frame = frame.f_back
    return None


# Where modules were constructed: id(module) -> (weak reference, "file:line" or None). Noted only
# while ``noting_construction()`` runs (the command line builds its model inside it); a model built
# before ``audit()`` has none, and its modules' sites are unknown.
constructed: dict[int, tuple[weakref.ref, Optional[str]]] = {}
_CONSTRUCTORS = ("__init__", "__post_init__")


def _forget(key: int, ref: weakref.ref) -> None:
    entry = constructed.get(key)
    if entry is not None and entry[0] is ref:
        del constructed[key]


def _constructing(frame: Any, module: nn.Module) -> bool:
    """Is ``frame`` a constructor of ``module`` itself (a subclass's ``__init__`` calling super)?"""
    code = frame.f_code
    if code.co_name not in _CONSTRUCTORS or not code.co_argcount:
        return False
    return frame.f_locals.get(code.co_varnames[0]) is module


def construction_line(module: nn.Module, frame: Any) -> Optional[str]:
    """The innermost line, from ``frame`` outwards, outside torch, gradaudit, driver code and
    ``module``'s own constructors: the line that constructed it (``nn.Linear(4, 8),`` inside the
    user's ``nn.Sequential(...)``; ``self.fc = nn.Linear(...)`` inside a parent's ``__init__``)."""
    while frame is not None:
        if not _is_internal(frame.f_code) and not _constructing(frame, module):
            return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def construction_site(module: nn.Module) -> Optional[str]:
    """Where ``module`` was constructed, when noted by ``noting_construction()``; else None."""
    entry = constructed.get(id(module))
    if entry is not None and entry[0]() is module:
        return entry[1]
    return None


@contextlib.contextmanager
def noting_construction() -> Iterator[None]:
    """Note the construction line of every ``nn.Module`` constructed inside (see ``construction_site``).

    torch has no hook for a module's construction (its global registration hooks fire when a module
    is assigned to a parent, inside ``nn.Sequential.__init__`` for its children, where the user's
    line is the container's), so ``nn.Module.__init__`` is wrapped while the block runs and put back
    after it, also when it raises.
    """
    original = nn.Module.__init__
    if getattr(original, "_gradaudit_noting", False):  # nested: the outer one notes
        yield
        return

    @functools.wraps(original)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        key = id(self)
        entry = constructed.get(key)
        if entry is not None and entry[0]() is self:
            return  # Module.__init__ run again on a built module: it was constructed where first seen
        try:
            ref = weakref.ref(self, lambda ref, key=key: _forget(key, ref))
        except TypeError:  # a subclass with __slots__ and no __weakref__: cannot be followed
            return
        constructed[key] = (ref, construction_line(self, sys._getframe(1)))

    __init__._gradaudit_noting = True  # type: ignore[attr-defined]
    nn.Module.__init__ = __init__  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.__init__ = original  # type: ignore[method-assign]
