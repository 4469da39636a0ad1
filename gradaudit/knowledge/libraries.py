"""What the backward of popular libraries' custom autograd Functions reads, declared by node name.

A Python ``torch.autograd.Function`` makes a node named after its class (``<Function>Backward``;
``torch.library.register_autograd`` makes ``GeneratedBackwardFor_<namespace>_<op>_<overload>Backward``).
These are declared by that name, as ``declare_function`` would, without importing the library.
Another library's Function of the same class name makes a node of the same name: a declaration
here therefore says only what backward reads whenever the node runs ("needed"), which can cost a
finding but never a gradient, and its other saves stay unknown (``registry.declare`` enforces it).

Each is proven like torch's own nodes: a generated case in tests/test_knowledge.py, where the
static verdicts must equal the proven ones.
"""

from __future__ import annotations

from .registry import Read, declare

# BLOOM's GELU (transformers.models.bloom.modeling_bloom.GeLUFunction, from Megatron-DeepSpeed): saves
# its input; backward is bloom_gelu_back(grad, input), the tanh approximation's derivative at the input
declare("GeLUFunctionBackward", library="transformers", edges=("input",),
        source="transformers models/bloom/modeling_bloom.py GeLUFunction.backward: bloom_gelu_back(grad, input)",
        saves={"saved_tensors[0]": Read(why="the derivative of the tanh-approximated GELU is computed from the input")})

# torchvision.ops.roi_align (Faster/Mask R-CNN's MultiScaleRoIAlign): registered with
# torch.library.register_autograd, whose setup_context saves the boxes only (the input's shape is
# kept as a plain attribute). The backward always calls the _roi_align_backward kernel, which reads
# each box (batch index and corners) to scatter the output bins' gradients into the input's
# gradient; the boxes themselves get no gradient (None). The boxes are read whatever gradients are
# wanted: with only the boxes wanted the input's gradient is still computed (then dropped), and the
# kernel casts rois[:, 0] to a batch index without a bounds check, so a placeholder of other values
# would make it write out of bounds
declare("GeneratedBackwardFor_torchvision_roi_align_defaultBackward", library="torchvision", edges=("input", "rois"),
        source="torchvision _autograd_registrations.py _roi_align_backward; csrc/ops/cpu/roi_align_kernel.cpp",
        saves={"saved_tensors[0]": Read(why="the boxes say where each output bin's gradient goes in the input")})
