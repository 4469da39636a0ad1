"""``gradaudit.trim(model)``: while installed, each forward keeps only what backward can need.

Two kinds of forward, chosen per forward by ``handle.Engine``:

- **decided fully** (``session``; the first forward, and again whenever what the decisions depend
  on changes: which parameters and inputs need a gradient, train/eval, dtypes, devices, autocast).
  A saved-tensors hook boxes every save and a node-creation hook lists the new autograd nodes; at
  every module boundary (Python level, no op in flight) the nodes created since the last one are
  decided with the static op knowledge of ``gradaudit/knowledge`` and their boxes rewritten:

  - not needed: the box forgets the tensor. Backward gets an unfilled tensor of the same shape,
    dtype, device and strides (all strides 0 where only the shape is read, ``Reads.SHAPE``);
  - one bit per element is enough (when ``bitpack``; ReLU results, dropout masks,
    ``Reads.SIGN``/``MASK``): the box keeps the bits and backward gets a tensor with the saved
    strides on which the op's backward computes exactly what it did before. Such a save waits one
    module boundary first: when the next op keeps the same tensor anyway (a trainable conv after a
    ReLU), packing would free nothing;
  - otherwise the box keeps the tensor.

  The forward also records, per module call, the path from its output to each node it changed.
- **steady** (``steady``; every other forward): only the modules whose calls made a changed node
  have a hook; from the call's output it follows the recorded path, checks that the node found is
  still what was decided on, and gives the changed saves their own pack and unpack hooks
  (``SavedTensor.register_hooks``). Nothing else is looked at: modules and saves trim leaves
  alone cost nothing.

Deciding as the forward proceeds lowers the peak, not only what is held after the forward.
Saves packed by anybody else's hooks (``torch.utils.checkpoint``, ``save_on_cpu``, the user's
own ``saved_tensors_hooks`` inside the model) are never touched.

Modules: ``codec`` (bits and stand-ins), ``plan`` (decisions from the op knowledge), ``session``
(a forward decided fully), ``steady`` (the steady plan), ``handle`` (``trim``, ``TrimHandle``,
``compare``).
"""

from .handle import TrimHandle, compare, is_trimmed, trim

__all__ = ["trim", "TrimHandle", "compare", "is_trimmed"]
