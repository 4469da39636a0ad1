"""The CPU dispatcher's attention choice, asked once per distinct call (gradaudit/sdpa.py)."""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradaudit import kernel_cache, sdpa
from gradaudit.sdpa import cpu_choice, sdpa_arguments, sdpa_backend


def _bound(device="meta", dtype=torch.float32, mask=None, requires_grad=True, **kwargs):
    q = torch.empty(2, 4, 16, 8, device=device, dtype=dtype).requires_grad_(requires_grad)
    return sdpa_arguments((q, q, q), {"attn_mask": mask, **kwargs})


def test_a_remembered_choice_is_the_dispatchers_and_is_asked_once():
    sdpa._CHOICES.clear()
    bound = _bound()
    asked = sdpa_backend(bound)
    assert cpu_choice(bound) == asked
    assert len(sdpa._CHOICES) == 1
    assert cpu_choice(_bound()) == asked  # the same metadata: answered from memory
    assert len(sdpa._CHOICES) == 1


def test_what_the_choice_depends_on_is_in_the_key():
    # each changes the CPU's answer (flash -> math) or may: a remembered answer must not stand for it
    sdpa._CHOICES.clear()
    plain = _bound()
    flash = cpu_choice(plain)
    assert flash == int(SDPBackend.FLASH_ATTENTION)
    with sdpa_kernel(SDPBackend.MATH):  # torch's global settings
        assert cpu_choice(plain) == int(SDPBackend.MATH) == sdpa_backend(plain)
    three_dims = sdpa_arguments((torch.empty(4, 16, 8, device="meta"),) * 3, {})  # shapes
    assert cpu_choice(three_dims) == sdpa_backend(three_dims)
    # a transposed query whose last dimension is not contiguous (strides)
    q = torch.empty(2, 4, 8, 16, device="meta").transpose(-1, -2)
    strided = sdpa_arguments((q, q, q), {})
    assert cpu_choice(strided) == sdpa_backend(strided)
    for bound in (_bound(dropout_p=0.1), _bound(is_causal=True), _bound(dtype=torch.bfloat16),
                  _bound(requires_grad=False), _bound(mask=torch.zeros(2, 1, 16, 16, device="meta"))):
        assert cpu_choice(bound) == sdpa_backend(bound)
    assert cpu_choice(plain, dropout_p=0.0) == sdpa_backend(plain, dropout_p=0.0)
    assert len(sdpa._CHOICES) >= 8  # each a key of its own


def test_checking_asks_again_and_catches_a_wrong_memory():
    sdpa._CHOICES.clear()
    bound = _bound()
    cpu_choice(bound)
    key = next(iter(sdpa._CHOICES))
    sdpa._CHOICES[key] = int(SDPBackend.MATH)  # a memory that is wrong
    with kernel_cache.checking():
        try:
            cpu_choice(bound)
        except AssertionError as error:
            assert "the dispatcher picks" in str(error)
        else:
            raise AssertionError("a wrong remembered choice went unnoticed")
    sdpa._CHOICES.clear()


def test_gpu_queries_are_not_remembered():
    # another device's choice also follows the GPU and its environment: asked every time (here a
    # subclass stands in for what the key cannot describe, and is not remembered either)
    sdpa._CHOICES.clear()

    class Other(torch.Tensor):
        pass

    q = torch.empty(2, 4, 16, 8).as_subclass(Other)
    bound = sdpa_arguments((q, q, q), {})
    assert cpu_choice(bound) == sdpa_backend(bound)
    assert not sdpa._CHOICES
