"""Values beside meta tensors (gradaudit/values.py): what is known, what is forgotten, what is assumed."""

from __future__ import annotations

import torch
from torch import nn

import gradaudit
from gradaudit.values import MAX_ELEMENTS, VALUES, KnownValues, to_meta


def test_contents_made_on_meta_keep_their_values_through_ops_and_writes():
    with gradaudit.meta_device():
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[1, -2:] = 0  # an in-place write through a view: the copy follows it
        ids = torch.tensor([[5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 0, 0]])
        positions = torch.arange(6).expand(2, -1)
        assert mask.is_meta and ids.is_meta and positions.is_meta
        assert mask.tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
        assert bool(mask.all()) is False
        assert (ids * mask).sum().item() == 5 + 6 + 7 + 8 + 9 + 10 + 1 + 2 + 3 + 4
        assert ids[:, [-1, 0]].tolist() == [[10, 5], [0, 1]]  # a list index
        assert mask.nonzero().shape == (10, 2)  # a shape that depends on values
        assert positions[1].tolist() == list(range(6))


def test_cpu_inputs_beside_a_meta_model_become_meta_with_their_values():
    x = torch.arange(12.0).reshape(3, 4).t().requires_grad_()  # non-contiguous, requires grad
    (meta,) = to_meta((x,))
    assert meta.is_meta and meta.requires_grad and meta.stride() == x.stride()
    assert torch.equal(VALUES.value(meta), x.detach())


def test_a_write_nobody_followed_forgets_the_copy():
    with gradaudit.meta_device():
        t = torch.zeros(4, dtype=torch.long)
    assert VALUES.value(t) is not None
    t.add_(1)  # outside the mode: its version moved, the copy is stale
    assert VALUES.value(t) is None
    with gradaudit.meta_device():
        u = torch.zeros(4, dtype=torch.long)
        u.add_(torch.empty(4, dtype=torch.long))  # an unknown operand: forgotten, not guessed
    assert VALUES.value(u) is None


def test_storages_over_the_limit_keep_no_copy():
    with gradaudit.meta_device():
        small = torch.zeros(MAX_ELEMENTS, dtype=torch.bool)
        large = torch.zeros(MAX_ELEMENTS + 1, dtype=torch.bool)
    assert VALUES.value(small) is not None and VALUES.value(large) is None


def test_an_unknown_read_is_assumed_once_and_nothing_is_built_on_it():
    with torch.device("meta"), KnownValues() as mode:
        unknown = torch.randn(5)  # random: no value known
        assert bool((unknown > 0).all()) is True  # assumed: the bool tensor held ones
        hits = (unknown > 0).nonzero()  # assumed all non-zero: every element found
        assert hits.shape == (5, 1)
        hits.tolist()  # the found indices follow from an assumption: unknown, assumed again
    assert [read.op for read in mode.reads] == ["aten._local_scalar_dense", "aten.nonzero", "aten._to_copy"]
    assert all(read.assumed == "all ones" and "test_values.py:" in read.where for read in mode.reads)
    assert len(mode.notes) == 3 and all("nobody knows" in note for note in mode.notes)


def test_the_copies_are_not_counted_as_memory_the_forward_holds():
    # a literal made inside the forward on meta: its CPU copy is gradaudit's bookkeeping
    class UsesALiteral(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            scale = torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)
            return self.fc(x * scale)  # saves x * scale (2*4 floats = 32 B) for the weight gradient

    with torch.device("meta"):
        model = UsesALiteral()
    report = gradaudit.audit(model, torch.ones(2, 4))
    from gradaudit.measure import held_bytes_after_forward
    from gradaudit.meta import standing_for

    with standing_for("cpu"):
        held = held_bytes_after_forward(model, to_meta(torch.ones(2, 4)))
    assert report.saved_bytes == held == 32
