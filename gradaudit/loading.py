"""Turn the command line's words into a model and its inputs: SPECs, shapes, dtypes and sizes.

A SPEC names a factory: ``path/to/file.py:build`` or ``package.module:build``. The factory returns a
module, or ``(module, inputs)``. Every failure raises LoadError with one or two lines for a person.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .collecting import collecting_only_new
from .errors import GradauditError, LoadError

_DOTTED_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class Spec:
    target: str  # a file path or a dotted module name
    attr: str  # dotted attribute inside it
    is_path: bool

    def __str__(self) -> str:
        return f"{self.target}:{self.attr}"


def parse_spec(text: str) -> Spec:
    """``file.py:factory`` or ``package.module:factory``; the last colon separates (Windows drives)."""
    target, sep, attr = text.rpartition(":")
    if not sep or not target or not attr:
        raise LoadError(f"malformed SPEC {text!r}: expected path/to/file.py:factory or package.module:factory")
    if not _DOTTED_NAME.match(attr):
        raise LoadError(f"malformed SPEC {text!r}: {attr!r} is not a Python name "
                        f"(expected path/to/file.py:factory or package.module:factory)")
    is_path = target.endswith(".py") or "/" in target or os.sep in target
    if not is_path and not _DOTTED_NAME.match(target):
        raise LoadError(f"malformed SPEC {text!r}: {target!r} is neither a .py file nor a dotted module name")
    return Spec(target, attr, is_path)


def _import_file(path: str) -> Any:
    if not os.path.exists(path):
        raise LoadError(f"file not found: {path} (SPEC is path/to/file.py:factory, relative to "
                        f"{os.getcwd()})")
    if os.path.isdir(path):
        raise LoadError(f"{path} is a directory; SPEC needs a .py file or a dotted module name")
    path = os.path.abspath(path)
    # Like `python file.py`: the file's folder comes first on sys.path, so siblings import.
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = "gradaudit_user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot import {path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        sys.modules.pop(name, None)
        where = f"{error.filename or path}:{error.lineno}" if error.lineno else path
        raise LoadError(f"syntax error in {where}: {error.msg}\n"
                        f"fix the file, then run the scan again") from error
    except Exception as error:
        sys.modules.pop(name, None)
        raise LoadError(f"importing {path} raised {type(error).__name__}: {first_line(error)}") from error
    return module


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and (name == error.name or name.startswith(error.name + ".")):
            raise LoadError(f"no module named {error.name!r} (is it installed, or did you mean a "
                            f"path like {name.replace('.', '/')}.py:...?)") from error
        raise LoadError(f"importing {name} raised ModuleNotFoundError: {first_line(error)}") from error
    except SyntaxError as error:
        raise LoadError(f"syntax error in {error.filename}:{error.lineno}: {error.msg}") from error
    except Exception as error:
        raise LoadError(f"importing {name} raised {type(error).__name__}: {first_line(error)}") from error


def load_object(text: str) -> Any:
    """Import the SPEC's target and return the named attribute (usually a factory)."""
    spec = parse_spec(text)
    module = _import_file(spec.target) if spec.is_path else _import_module(spec.target)
    value: Any = module
    for part in spec.attr.split("."):
        if not hasattr(value, part):
            candidates = sorted(n for n, v in vars(module).items()
                                if callable(v) and not n.startswith("_")
                                and getattr(v, "__module__", None) == module.__name__)
            hint = f"; it defines: {', '.join(candidates[:8])}" if candidates else ""
            raise LoadError(f"{spec.target} has no attribute {spec.attr!r}{hint}")
        value = getattr(value, part)
    return value


def first_line(error: BaseException) -> str:
    """The error's first line, whole (the command line wraps long lines; it never cuts them)."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def call(factory: Callable[[], Any], what: str, device: Optional[str] = None) -> Any:
    """Call a factory with no arguments; on ``meta`` inside ``torch.device("meta")``, where the
    tensors it makes with known contents (token ids, masks, positions) keep their values
    (``gradaudit.meta_device``)."""

    from .values import meta_device

    if not callable(factory):
        return factory
    try:
        # (a model's build makes hundreds of thousands of objects: its collections look at those, not at torch's)
        with collecting_only_new():
            if device == "meta":
                with meta_device():
                    return factory()
            return factory()
    except GradauditError:
        raise
    except Exception as error:
        raise LoadError(f"{what} raised {type(error).__name__}: {first_line(error)}") from error


def build_model(text: str, device: Optional[str] = None, schedules: bool = False) -> tuple[Any, Any]:
    """Load and call the model factory: returns ``(module, inputs or None)``; with ``schedules``, the
    module may be a ``torch.distributed.pipelining`` schedule (one rank's stage, for ``fit`` and ``scan``).

    Every module constructed meanwhile (by the factory, or at import time for a SPEC naming a
    module object) has its construction line noted: the source of ops that run only torch code
    inside the forward (``nn.Sequential`` and its layers) is the line that built their layer.
    """
    from torch import nn

    from .recorder import noting_construction
    from .torchapi.pipelining import is_schedule

    with noting_construction():
        factory = load_object(text)
        result = factory if isinstance(factory, nn.Module) else call(factory, f"the factory {text}", device)
    inputs = None
    if isinstance(result, tuple) and len(result) == 2 and (isinstance(result[0], nn.Module)
                                                           or is_schedule(result[0])):
        result, inputs = result
    if is_schedule(result) and not schedules:
        raise LoadError(f"the factory {text} returned a pipeline schedule ({type(result).__name__}): plan takes "
                        f"a module (the stage's: stage.submod); scan audits the stage on one micro-batch and fit "
                        f"runs the schedule's step")
    if not isinstance(result, nn.Module) and not is_schedule(result):
        raise LoadError(f"the factory {text} returned {type(result).__name__}, not a torch.nn.Module; "
                        f"return the model, or (model, inputs)")
    return result, inputs


def load_inputs(text: str, device: Optional[str] = None) -> Any:
    """``--inputs SPEC``: a factory returning inputs (a Tensor, a tuple, a dict), or the value itself."""
    return call(load_object(text), f"the inputs factory {text}", device)


def parse_shape(text: str) -> tuple[int, ...]:
    parts = [p for p in re.split(r"[,x ]", text.strip()) if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d < 0 for d in shape):
        raise LoadError(f"malformed --input-shape {text!r}: expected sizes like 8,3,224,224")
    return shape


def parse_dtype(text: str) -> Any:
    import torch

    name = text.strip().removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise LoadError(f"unknown --dtype {text!r}: expected float32, bfloat16, float16, int64, ...")
    return dtype


def random_input(shape: tuple[int, ...], dtype: Any, device: str, requires_grad: bool = False) -> Any:
    """One tensor for ``--input-shape``: normal floats, or zeros for integer dtypes (valid token ids)."""
    import torch

    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
    if requires_grad:
        raise LoadError(f"--input-requires-grad needs a floating --dtype, not {dtype}")
    if device == "meta":  # token ids whose values the model may read: kept beside the meta tensor
        from .values import to_meta

        return to_meta(torch.zeros(shape, dtype=dtype))
    return torch.zeros(shape, dtype=dtype, device=device)


def to_device(value: Any, device: str) -> Any:
    """Move every tensor inside nested tuples/lists/dicts, keeping requires_grad (a what-if input)."""
    import torch

    if isinstance(value, torch.Tensor):
        if str(value.device) == device or value.device.type == device:
            return value
        if device == "meta":  # its values may decide what the model does: kept beside the meta tensor
            from .values import to_meta

            return to_meta(value)
        moved = value.detach().to(device)
        return moved.requires_grad_(value.requires_grad) if moved.is_floating_point() else moved
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(to_device(v, device) for v in value)
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    return value
