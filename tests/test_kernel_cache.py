"""The meta kernel cache (gradaudit/kernel_cache.py): a call answered from it is the kernel's call to
the byte, and what it must not answer, it runs. (The whole suite runs under ``kernel_cache.checking()``,
conftest.py: every answer is compared with the kernel's.)"""

from __future__ import annotations

import pytest
import torch

import gradaudit
from gradaudit import kernel_cache
from gradaudit.meta import DeviceKernelsOnMeta
from gradaudit.torchapi.dispatch import TorchDispatchMode


class _Seen(TorchDispatchMode):
    """A mode that notes the ops it sees (as a storage tracker would)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _meta(*shape, **options) -> torch.Tensor:
    return torch.empty(*shape, device="meta", **options)


@pytest.fixture
def fresh():
    kernel_cache.clear()
    yield
    kernel_cache.clear()


def test_an_identical_call_is_answered_without_its_kernel_and_equals_it(fresh):
    x, y = _meta(4, 8), _meta(8)
    with DeviceKernelsOnMeta():
        first = x * y
        second = x * y
    assert kernel_cache.counts() == (1, 1)  # the second call: one hit, after one miss
    assert (second.shape, second.stride(), second.dtype) == (first.shape, first.stride(), first.dtype)
    # a fresh storage of the kernel's size: 4 * 8 float32 elements = 128 bytes, not the first call's
    assert second.untyped_storage().nbytes() == 128
    assert second.untyped_storage()._cdata != first.untyped_storage()._cdata


def test_what_the_outputs_depend_on_is_in_the_key(fresh):
    with DeviceKernelsOnMeta():
        contiguous = _meta(2, 3, 4, 5) + 1
        channels_last = _meta(2, 3, 4, 5).contiguous(memory_format=torch.channels_last) + 1
        as_int = _meta(4, dtype=torch.int64) * 2
        as_float = _meta(4, dtype=torch.int64) * 2.0  # a Python float promotes to the default dtype
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            as_double = _meta(4, dtype=torch.int64) * 2.0
        finally:
            torch.set_default_dtype(previous)
        rows = _meta(4, 3) + 1
        columns = _meta(3, 4).t() + 1  # the same sizes (4, 3), strides (1, 4): the output keeps them
    assert contiguous.is_contiguous() and channels_last.is_contiguous(memory_format=torch.channels_last)
    assert (as_int.dtype, as_float.dtype, as_double.dtype) == (torch.int64, torch.float32, torch.float64)
    assert (rows.stride(), columns.stride()) == ((3, 1), (1, 4))
    assert kernel_cache.counts()[0] == 0  # every call differs in something its outputs depend on


def test_views_writes_and_cpu_tensors_always_run_their_kernels(fresh):
    x = _meta(4, 8)
    with DeviceKernelsOnMeta():
        for _ in range(2):
            view = x.t()  # aliases its input: a view is never remade
            x.add_(1)  # writes its input
            torch.mul(torch.ones(2), 3)  # a CPU op computes values
    assert view.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert kernel_cache.counts() == (0, 0)


def test_with_a_mode_below_every_call_runs_its_kernel(fresh):
    """A mode below the caller must see every op: nothing is answered from the cache then."""
    x = _meta(4, 8)
    seen = _Seen()
    with seen, DeviceKernelsOnMeta():
        for _ in range(3):
            x * 2
    assert seen.ops == ["aten.mul.Tensor"] * 3
    assert kernel_cache.counts() == (0, 0)


def test_checking_catches_a_remade_output_that_differs(fresh):
    x = _meta(4, 8)
    with DeviceKernelsOnMeta():
        x * 2
    key = next(iter(kernel_cache._state.entries))
    container, ((shape, stride, dtype),) = kernel_cache._state.entries[key]
    kernel_cache._state.entries[key] = (container, ((shape, stride, torch.float16),))  # a wrong entry
    with kernel_cache.checking(), DeviceKernelsOnMeta(), pytest.raises(AssertionError, match="its kernel gives"):
        x * 2


def test_a_model_audited_with_and_without_the_cache_gives_the_same_report(fresh, tiny_hf_model):
    """A Llama on meta (padded batch, labels, half frozen): every figure equal, most calls answered."""
    model = tiny_hf_model("llama").to("meta")
    ids = torch.zeros(2, 16, dtype=torch.long)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    frozen = ["model.embed_tokens.*", "model.layers.0.*"]
    with kernel_cache.disabled():
        without = gradaudit.audit(model, inputs, frozen=frozen).to_dict()
    assert kernel_cache.counts() == (0, 0)
    first = gradaudit.audit(model, inputs, frozen=frozen).to_dict()
    second = gradaudit.audit(model, inputs, frozen=frozen).to_dict()
    hits, misses = kernel_cache.counts()
    assert first == without and second == without
    assert misses > 0 and hits > 3 * misses  # the second audit's calls all hit; the first's layers too


class _Block(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        if bool(mask[:, -1].any()):  # a branch on the batch's values (known beside the meta tensors)
            h = h * mask[:, :, None].to(h.dtype)
        return x + self.drop(h)


class _Repeats(torch.nn.Module):
    """Eight blocks of one shape that differ where reuse would go wrong: a block in bfloat16, one in
    eval mode, one frozen, one whose output a forward hook replaces with a transposed copy, one that
    takes a channels-last-like strided input, and a branch on the mask's values in each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(8))
        self.blocks[2].to(torch.bfloat16)
        self.blocks[3].eval()
        self.blocks[4].requires_grad_(False)
        self.blocks[5].register_forward_hook(lambda module, args, out: out.transpose(0, 1).contiguous().transpose(0, 1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == 2:
                x = block(x.to(torch.bfloat16), mask).float()
            elif i == 6:
                x = block(x.transpose(0, 1).contiguous().transpose(0, 1), mask)  # strides (32, 64*32... ) differ
            else:
                x = block(x, mask[i % 2:] if i == 7 else mask)  # block 7: the mask's other rows (the branch differs)
        return x


def test_blocks_that_differ_where_reuse_would_go_wrong_are_audited_as_without_the_cache(fresh):
    """Every difference the issue names (dtype, mode, trainability, a hook, strides, a branch on the
    input's values): the report on meta equals the one with every kernel run, and the CPU's bytes."""
    torch.manual_seed(0)
    model = _Repeats()
    meta_model = _Repeats().to("meta")
    x = torch.randn(2, 64, 32)
    mask = torch.ones(2, 64)
    mask[1, -8:] = 0  # the second row padded: mask[:, -1].any() is True for rows (0, 1), False for row 1 alone
    inputs = gradaudit.Args(x.to("meta").requires_grad_(), mask)
    with kernel_cache.disabled():
        without = gradaudit.audit(meta_model, inputs).to_dict()
    cached = gradaudit.audit(meta_model, inputs)
    hits, _ = kernel_cache.counts()
    assert hits > 0 and cached.to_dict() == without
    on_cpu = gradaudit.audit(model, gradaudit.Args(x.clone().requires_grad_(), mask))
    assert (cached.saved_bytes, len(cached.tensors)) == (on_cpu.saved_bytes, len(on_cpu.tensors))
