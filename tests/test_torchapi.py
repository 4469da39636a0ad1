"""The one door to private torch APIs (the gradaudit/torchapi package): each feature pinned on the installed torch,
recognition by identity, and a clear error where a feature is missing."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from torch import nn

import gradaudit
from gradaudit import GradauditError, torchapi
from gradaudit.records import Manager
from gradaudit.torchapi.autograd import manager_of, node_type_exists, push_node_creation_hook
from gradaudit.torchapi.dispatch import first_overload_schema, overload_packet
from gradaudit.torchapi.modules import add_forward_hooks, hook_counts, remove_forward_hooks
from gradaudit.torchapi.storages import storage_id, storage_key

TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def test_features_present_on_the_supported_torch_releases():
    # every feature but the node-creation hook exists on 2.11 to 2.15; the hook arrived in 2.14
    for feature, present in torchapi.FEATURES.items():
        if feature == "node creation hook":
            assert present == (TORCH >= (2, 14)), feature
        else:
            assert present, feature


# (code, not comments or ``quoted`` names in docstrings) a private name of a torch module (torch._C,
# torch.utils._pytree, nn.modules.batchnorm._BatchNorm, UntypedStorage._new_with_weak_ptr), or one of
# the private tensor, node and module attributes gradaudit uses
_PRIVATE = re.compile(r"\btorch(\.\w+)*\._(?!_)\w|\bnn(\.\w+)*\._(?!_)\w|_raw_saved_|_saved_tensors_hooks_is_enabled"
                      r"|_top_saved_tensors_default|\._cdata|\._version\b|\._sequence_nr|\._input_metadata"
                      r"|\._parameters\b|\._buffers\b|\._modules\b|_NormBase|_BatchNorm|_overloadpacket|\._schema\b"
                      r"|\._is_view\b|_new_with_weak_ptr|\._local_tensor\b|\._orig_mod\b")
_PACKAGE = pathlib.Path(gradaudit.__file__).parent
_DOOR = _PACKAGE / "torchapi"


def _private_lines(paths):
    return [f"{path.relative_to(_PACKAGE)}:{n}" for path in paths
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if _PRIVATE.search(re.sub(r"``[^`]*``", "", line.split("#")[0]))]


def test_no_module_of_gradaudit_but_torchapi_reaches_into_torch_privately():
    outside = [path for path in _PACKAGE.rglob("*.py") if _DOOR not in path.parents]
    assert len(outside) > 50
    offenders = _private_lines(outside)
    assert not offenders, offenders


def test_the_door_is_what_reaches_into_torch_privately():
    # the same pattern finds the private names in the door's rooms: the test above can fail
    found = _private_lines(_DOOR.glob("*.py"))
    for room in ("features", "autograd", "checkpoint", "kernels", "modules", "storages", "fsdp", "dispatch"):
        assert any(line.startswith(f"torchapi/{room}.py:") for line in found), room


def test_operator_packets_and_schemas():
    # what the planner reads of an op: its packet (selective checkpoints keep costly ops' outputs) and
    # whether its first overload returns an alias (a view: no FLOPs counted for it)
    aten = torch.ops.aten
    assert overload_packet(aten.mm.default) is aten.mm and overload_packet(aten.mm) is aten.mm
    assert any(r.alias_info is not None for r in first_overload_schema(aten.view).returns)
    assert all(r.alias_info is None for r in first_overload_schema(aten.mm).returns)
    assert first_overload_schema(object()) is None


def test_managers_are_recognised_by_identity():
    x = torch.randn(4, 4, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        offloaded = torch.sin(x).grad_fn
    assert manager_of(offloaded._raw_saved_self.unpack_hook) == Manager.OFFLOAD

    def unpack_from_cpu(t):  # the same name, somebody else's hook: not offloading as far as anyone knows
        return t

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack_from_cpu):
        hooked = torch.sin(x).grad_fn
    assert manager_of(hooked._raw_saved_self.unpack_hook) == Manager.HOOKS


def test_storage_keys_agree():
    t = torch.randn(3, 4)
    view = t[1:]
    assert storage_key(view) == storage_key(t) == storage_id(t.untyped_storage())


def test_node_types_are_looked_up_in_the_installed_torch():
    assert node_type_exists("ConvolutionBackward0")
    assert not node_type_exists("CrossEntropyLossBackward0")  # cross_entropy decomposes


def test_a_missing_feature_is_refused_clearly(monkeypatch):
    """A feature torch lacks is a GradauditError naming it, the release it came in and the installed one."""
    monkeypatch.setitem(torchapi.FEATURES, "node creation hook", False)
    with pytest.raises(GradauditError, match=r"node creation hook \(torch >= 2\.14\), which torch .* does not have"):
        push_node_creation_hook(lambda node: None, "this test")


def test_forward_hooks_are_added_and_removed_as_register_does():
    # the tracker's cheap path writes the entries register_forward_(pre_)hook would write
    def pre(module, args):
        return None

    def post(module, args, output):
        return None

    registered, added = nn.Linear(2, 2), nn.Linear(2, 2)
    handles = [registered.register_forward_pre_hook(pre), registered.register_forward_hook(post, always_call=True)]
    token = add_forward_hooks(added, pre, post)
    for name in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called",
                 "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs"):
        assert list(getattr(added, name).values()) == list(getattr(registered, name).values()), name
    assert list(added._forward_pre_hooks) == [token[0]] and list(added._forward_hooks) == [token[0] + 1]
    for handle in handles:
        handle.remove()
    remove_forward_hooks(token)
    assert hook_counts(added) == hook_counts(registered) == (0, 0, 0, 0)
    assert not added._forward_hooks_always_called


def test_forward_hooks_of_a_class_that_registers_its_own_way_go_through_its_methods():
    seen = []

    class Own(nn.Linear):
        def register_forward_pre_hook(self, hook, **kwargs):
            seen.append("pre")
            return super().register_forward_pre_hook(hook, **kwargs)

    module = Own(2, 2)
    token = add_forward_hooks(module, lambda m, a: None, lambda m, a, o: None)
    assert seen == ["pre"] and hook_counts(module)[:2] == (1, 1)
    remove_forward_hooks(token)
    assert hook_counts(module) == (0, 0, 0, 0)
