"""``gradaudit.trim(model)``: while installed, each forward keeps only what backward can need.

Mechanism: during the model's forward, a saved-tensors hook boxes every save and a node-creation
hook lists the new autograd nodes. At every module boundary (Python level, no op in flight) the
nodes created since the last boundary are decided with the static op knowledge of
``gradaudit/knowledge`` and their boxes rewritten:

- not needed: the box forgets the tensor. Backward gets an unfilled tensor of the same shape, dtype,
  device and strides, made when it reads them (a zero-stride ``torch.zeros(()).expand(shape)`` where
  only the shape is read, ``Reads.SHAPE``);
- one bit per element is enough (when ``bitpack``; ReLU results, dropout masks, ``Reads.SIGN``/``MASK``): the
  box keeps the bits and backward gets a tensor with the saved strides on which the op's backward
  computes exactly what it did before. Such a save waits one module boundary first: when the next
  op keeps the same tensor anyway (a trainable conv after a ReLU), packing would free nothing;
- otherwise the box keeps the tensor.

Deciding as the forward proceeds lowers the peak, not only what is held after the forward.
Saves packed by anybody else's hooks (``torch.utils.checkpoint``, ``save_on_cpu``, the user's
own ``saved_tensors_hooks`` inside the model) are never touched.

Modules: ``codec`` (bits and stand-ins), ``plan`` (decisions from the op knowledge), ``session``
(the hooks during a forward), ``handle`` (``trim``, ``TrimHandle``, ``compare``).
"""

from .handle import TrimHandle, compare, is_trimmed, trim

__all__ = ["trim", "TrimHandle", "compare", "is_trimmed"]
