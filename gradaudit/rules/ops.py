"""What each known autograd node's backward reads, given which of its inputs need a gradient.

Sources: PyTorch's tools/autograd/derivatives.yaml and the backward kernels (pytorch/pytorch
issue 133566 for convolution and batch norm). Every claim here is re-checked against the installed
torch by tests/test_rules_hold.py, which runs each op under the empirical proof.

Conservatism: a claim of "not needed" or "sign-only" must hold for every input, every device we
support, and every value. When an op has variants we have not checked, answer "unknown".
"""

from __future__ import annotations

from typing import Optional

from ..records import GraphNode, NEEDED, NOT_NEEDED, SIGN_ONLY, SavedTensor
from .registry import Verdict, needs


def _edge(node: GraphNode, i: int) -> bool:
    return i < len(node.edge_mask) and node.edge_mask[i]


@needs("ConvolutionBackward0")
def convolution(node: GraphNode, saved: dict[str, SavedTensor]) -> dict[str, Verdict]:
    # convolution_backward(grad, input, weight, ..., output_mask): grad_input reads weight,
    # grad_weight reads input, grad_bias reads neither.
    needs_input_grad, needs_weight_grad = _edge(node, 0), _edge(node, 1)
    return {
        "input": Verdict(NEEDED, "read by the weight gradient") if needs_weight_grad
        else Verdict(NOT_NEEDED, "only the weight gradient reads the input, and the weight needs no gradient"),
        "weight": Verdict(NEEDED, "read by the input gradient") if needs_input_grad
        else Verdict(NOT_NEEDED, "only the input gradient reads the weight, and the input needs no gradient"),
    }


@needs("NativeBatchNormBackward0", scalars=("training",))
def batch_norm(node: GraphNode, saved: dict[str, SavedTensor]) -> dict[str, Verdict]:
    needs_input_grad, needs_weight_grad = _edge(node, 0), _edge(node, 1)
    training = node.scalars.get("training")
    if training is True:
        return {
            "input": Verdict(NEEDED, "batch statistics depend on it"),
            "weight": Verdict(NEEDED, "read by the input gradient") if needs_input_grad
            else Verdict(NOT_NEEDED, "only the input gradient reads the weight, and the input needs no gradient"),
            "result1": Verdict(NEEDED, "saved batch mean, read in training mode"),
            "result2": Verdict(NEEDED, "saved inverse std, read in training mode"),
            # running stats are buffers (free); say needed rather than make a claim worth 0 bytes
            "running_mean": Verdict(NEEDED, "running statistics buffer"),
            "running_var": Verdict(NEEDED, "running statistics buffer"),
        }
    if training is not False:
        return {}
    # Eval mode: y = (x - running_mean) * invstd(running_var) * weight + bias.
    # grad_input = grad * weight * invstd; grad_weight = sum(grad * (x - mean) * invstd).
    return {
        "input": Verdict(NEEDED, "read by the weight gradient") if needs_weight_grad
        else Verdict(NOT_NEEDED, "in eval mode only the weight gradient reads the input, and the weight needs no gradient"),
        "running_mean": Verdict(NEEDED, "read by the weight gradient") if needs_weight_grad
        else Verdict(NOT_NEEDED, "in eval mode only the weight gradient reads the running mean"),
        "running_var": Verdict(NEEDED, "read by the input and weight gradients")
        if (needs_input_grad or needs_weight_grad)
        else Verdict(NOT_NEEDED, "no gradient of this node is required"),
        "weight": Verdict(NEEDED, "read by the input gradient") if needs_input_grad
        else Verdict(NOT_NEEDED, "only the input gradient reads the weight, and the input needs no gradient"),
        "result1": Verdict(NOT_NEEDED, "batch mean is not used in eval mode"),
        "result2": Verdict(NOT_NEEDED, "batch inverse std is not used in eval mode"),
    }


@needs("MaxPool1DWithIndicesBackward0", "MaxPool2DWithIndicesBackward0", "MaxPool3DWithIndicesBackward0")
def max_pool(node: GraphNode, saved: dict[str, SavedTensor]) -> dict[str, Verdict]:
    return {
        "self": Verdict(NOT_NEEDED, "the backward reads only the input's shape; the indices say where the maxima were"),
        "result1": Verdict(NEEDED, "the indices route the gradient"),
    }


@needs("ReluBackward0")
def relu(node: GraphNode, saved: dict[str, SavedTensor]) -> dict[str, Verdict]:
    return {"result": Verdict(SIGN_ONLY, "the backward reads only result > 0", bitpackable=True)}


@needs("LeakyReluBackward0")
def leaky_relu(node: GraphNode, saved: dict[str, SavedTensor]) -> dict[str, Verdict]:
    return {"self": Verdict(SIGN_ONLY, "the backward reads only self > 0", bitpackable=True)}


@needs("ThresholdBackward0", scalars=("threshold",))
def threshold(node: GraphNode, saved: dict[str, SavedTensor]) -> dict[str, Verdict]:
    if node.scalars.get("threshold") == 0:
        return {"self": Verdict(SIGN_ONLY, "the backward reads only self > 0", bitpackable=True)}
    return {"self": Verdict(NEEDED, "compared against the threshold")}


# nn.Dropout on CPU (and wherever native_dropout is not used) multiplies by a float mask.
DROPOUT_MODULES = ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d")
_FLOATS = ("float16", "bfloat16", "float32", "float64")


@needs("MulBackward0")
def mul(node: GraphNode, saved: dict[str, SavedTensor]) -> dict[str, Verdict]:
    # grad_self = grad * other, grad_other = grad * self; codegen saves each only when needed.
    verdicts = {attr: Verdict(NEEDED, "read by the gradient of the other factor") for attr in saved}
    mask = saved.get("other")
    if (mask is not None and mask.module_class in DROPOUT_MODULES and not _edge(node, 1)
            and mask.dtype in _FLOATS):
        verdicts["other"] = Verdict(NEEDED, "the dropout mask scales the gradient; it holds only 0 and "
                                            "1/(1-p), so one bit per element would do", bitpackable=True)
    return verdicts


# Ops whose every save is read by the gradient formula of an input that needs a gradient: PyTorch's
# codegen saves each tensor only when such a formula needs it (single-output derivative formulas).
# Reviewed one by one against derivatives.yaml; extend only after checking with verify=True.
_GUARDED = (
    "AddmmBackward0", "MmBackward0", "BmmBackward0", "AddbmmBackward0", "BaddbmmBackward0",
    "DivBackward0", "PowBackward0", "PowBackward1", "PowBackward2",
    "SoftmaxBackward0", "SafeSoftmaxBackward0", "LogSoftmaxBackward0", "GeluBackward0", "SiluBackward0", "SigmoidBackward0",
    "TanhBackward0", "HardtanhBackward0", "EluBackward0", "SoftplusBackward0", "HardswishBackward0",
    "HardsigmoidBackward0", "MishBackward0", "ExpBackward0", "LogBackward0", "SqrtBackward0",
    "RsqrtBackward0", "SinBackward0", "CosBackward0", "NativeLayerNormBackward0",
    "EmbeddingBackward0", "IndexBackward0", "GatherBackward0", "MeanBackward1", "NormBackward1",
    "ScaledDotProductFlashAttentionForCpuBackward0", "ScaledDotProductEfficientAttentionBackward0",
    "ScaledDotProductFlashAttentionBackward0", "NllLossBackward0", "CrossEntropyLossBackward0",
    "MseLossBackward0", "LinalgVectorNormBackward0", "ReciprocalBackward0", "NegBackward0",
    "AbsBackward0", "ClampBackward1", "ClampMinBackward0", "ClampMaxBackward0", "WhereBackward0",
    "MaxBackward0", "MinBackward0", "MaxBackward1", "MinBackward1", "AdaptiveMaxPool2DBackward0",
    "AvgPool2DBackward0", "AdaptiveAvgPool2DBackward0", "UpsampleNearest2DBackward0",
    "NativeGroupNormBackward0", "MaskedFillBackward0", "PreluKernelBackward0", "RreluWithNoiseBackward0",
    "ProdBackward0", "ProdBackward1", "CumsumBackward0", "VarMeanBackward0", "StdMeanBackward0",
    "SliceBackward0", "SelectBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "SoftmaxBackwardDataBackward0", "LinearBackward0",
)


def _guarded(node: GraphNode, saved: dict[str, SavedTensor]) -> dict[str, Verdict]:
    return {attr: Verdict(NEEDED, "read by the gradient formula of an input that needs a gradient")
            for attr in saved}


for _name in _GUARDED:
    needs(_name)(_guarded)


# Which gradient (edge number) reads a save, where a node computes several: a speed hint for the
# proof (verify.py), which proves "needed" by computing that one gradient alone. A wrong hint
# costs time, never a verdict (the full call follows). Edge order is the node's next_functions.
_READ_BY: dict[str, dict[str, tuple[int, ...]]] = {
    # convolution_backward: grad_input reads weight, grad_weight reads input
    "ConvolutionBackward0": {"input": (1,), "weight": (0,)},
    # addmm(self, mat1, mat2): grad_mat1 = grad @ mat2.T, grad_mat2 = mat1.T @ grad
    "AddmmBackward0": {"mat1": (2,), "mat2": (1,)},
    "MmBackward0": {"self": (1,), "mat2": (0,)},
    "BmmBackward0": {"self": (1,), "mat2": (0,)},
    # grad_weight = sum(grad * (x - mean) * invstd): reads the input and, in training, the saved
    # batch statistics; it is cheaper than grad_input (no tensor the size of the input written)
    "NativeBatchNormBackward0": {"input": (1,), "result1": (1,), "result2": (1,)},
}


def read_by(node_name: str, attr: str) -> Optional[tuple[int, ...]]:
    """The edges whose gradients read ``attr`` of ``node_name`` (None: not known)."""
    return _READ_BY.get(node_name, {}).get(attr)
