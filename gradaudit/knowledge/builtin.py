"""What the backward of PyTorch's own autograd nodes reads, one declaration per node type.

Sources: PyTorch's tools/autograd/derivatives.yaml and the backward kernels (pytorch/pytorch
issue 133566 for convolution and batch norm). Every declared name must exist in the installed
torch, and on a generated case of each the static verdicts must equal the proven ones
(tests/test_knowledge.py); the rule fixtures are re-checked under the proof too
(tests/test_rules_hold.py).

Conservatism: a claim of "not needed" or "sign-only" must hold for every input, every device we
support, and every value. When an op has variants we have not checked, leave it undeclared.
"""

from __future__ import annotations

from typing import Sequence

from .registry import Bit, Read, Reads, declare

DROPOUT_MODULES = ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d")

# -- convolution: one multi-output formula, so every save is made whenever any gradient is wanted
declare("ConvolutionBackward0", edges=("input", "weight", "bias"), weight="weight",
        source="derivatives.yaml convolution_backward; pytorch/pytorch#133566",
        saves={
            # convolution_backward(grad, input, weight, ..., output_mask): grad_input reads the
            # weight, grad_weight reads the input, grad_bias reads neither
            "input": Read(by=("weight",), witness="weight", rule="GA101"),
            "weight": Read(by=("input",), witness="input", rule="GA102"),
        })

# -- batch norm (native kernel: CPU, and CUDA when cuDNN is not chosen)
_BATCH_NORM = dict(edges=("input", "weight", "bias"), source="derivatives.yaml native_batch_norm_backward")
declare("NativeBatchNormBackward0", when={"training": True}, **_BATCH_NORM, saves={
    # in training the input gradient and the weight gradient both read the input and the batch
    # statistics; the bias gradient (sum of grad) reads none of them
    "input": Read(by=("input", "weight"), witness="weight", rule="GA202"),
    "weight": Read(by=("input",), rule="GA102"),
    "result1": Read(by=("input", "weight"), witness="weight", rule="GA202",
                    why="saved batch mean, read in training mode"),
    "result2": Read(by=("input", "weight"), witness="weight", rule="GA202",
                    why="saved inverse std, read in training mode"),
    # running statistics are buffers (free): say needed rather than make a claim worth 0 bytes
    "running_mean": Read(why="running statistics buffer"),
    "running_var": Read(why="running statistics buffer"),
})
# eval: y = (x - running_mean) * invstd(running_var) * weight + bias, so
# grad_input = grad * weight * invstd and grad_weight = sum(grad * (x - mean) * invstd)
_BATCH_NORM_EVAL = {
    "input": Read(by=("weight",), witness="weight", rule="GA201", unread="in eval mode only the weight gradient reads "
                                                       "the input, and the weight needs no gradient"),
    "running_mean": Read(by=("weight",), rule="GA201",
                         unread="in eval mode only the weight gradient reads the running mean"),
    "running_var": Read(by=("input", "weight"), rule="GA201", why="read by the input and weight gradients",
                        unread="no gradient of this node is required"),
    "weight": Read(by=("input",), rule="GA102"),
}
declare("NativeBatchNormBackward0", when={"training": False}, **_BATCH_NORM, saves={
    **_BATCH_NORM_EVAL,
    "result1": Read(reads=Reads.NOTHING, rule="GA201", unread="batch mean is not used in eval mode"),
    "result2": Read(reads=Reads.NOTHING, rule="GA201", unread="batch inverse std is not used in eval mode"),
})

# -- batch norm on CUDA through cuDNN (ATen's _select_batch_norm_backend picks it for most CUDA
# batch norms, in training and in eval; gradaudit/meta.py builds this node on meta for target="cuda").
# derivatives.yaml cudnn_batch_norm: in training the backward is one cudnn_batch_norm_backward call
# with no output mask (input, weight, result1, result2 and the reserve space result3 are passed
# whichever gradients are wanted), so every save is declared read: no claim about what cuDNN's closed
# kernel leaves unread (a bias-only pattern, whose bias gradient is sum(grad) in exact arithmetic,
# stays "needed" until a proof on a GPU shows otherwise). In eval the backward is the same
# native_batch_norm_backward(..., training=false, grad_input_mask) call as NativeBatchNormBackward0's,
# so the same reads hold; cuDNN's eval forward returns result1/result2 empty, and CUDA's
# batch_norm_backward_cuda only checks that they are empty (then it takes the running statistics).
_CUDNN = dict(edges=("input", "weight", "bias"),
              source="derivatives.yaml cudnn_batch_norm; ATen cuda/Normalization.cu batch_norm_backward_cuda")
_CUDNN_CALL = "passed to cudnn_batch_norm_backward, which computes every gradient in one call"
declare("CudnnBatchNormBackward0", when={"training": True}, **_CUDNN, saves={
    "input": Read(why=_CUDNN_CALL),
    "weight": Read(why=_CUDNN_CALL),
    "result1": Read(why="saved batch mean, " + _CUDNN_CALL),
    "result2": Read(why="saved inverse std, " + _CUDNN_CALL),
    "result3": Read(why="cuDNN's reserve space, " + _CUDNN_CALL),
    "running_mean": Read(why="running statistics buffer"),
    "running_var": Read(why="running statistics buffer"),
})
declare("CudnnBatchNormBackward0", when={"training": False}, **_CUDNN, saves={
    **_BATCH_NORM_EVAL,
    "result1": Read(reads=Reads.SHAPE, rule="GA201", unread="empty in eval mode: the backward checks only that "
                                                              "it is empty and uses the running mean"),
    "result2": Read(reads=Reads.SHAPE, rule="GA201", unread="empty in eval mode: the backward checks only that "
                                                              "it is empty and uses the running variance"),
    "result3": Read(reads=Reads.NOTHING, rule="GA201",
                    unread="cuDNN's reserve space is passed only to the training-mode backward"),
})

# -- layer and group norm: like batch norm in training, the bias gradient reads nothing saved
_NORM_STATS = dict(by=("input", "weight"), rule="GA202")
_NORM_SAVES = {
    "input": Read(**_NORM_STATS),
    "result1": Read(**_NORM_STATS, why="saved mean, read by the input and weight gradients"),
    "result2": Read(**_NORM_STATS, why="saved inverse std, read by the input and weight gradients"),
    "weight": Read(by=("input",), rule="GA102"),
}
declare("NativeLayerNormBackward0", edges=("input", "weight", "bias"), source="derivatives.yaml native_layer_norm",
        saves={**_NORM_SAVES, "bias": Read(reads=Reads.NOTHING, rule="GA202",
                                            unread="no gradient formula reads the bias")})
declare("NativeGroupNormBackward0", edges=("input", "weight", "bias"), source="derivatives.yaml native_group_norm",
        saves=_NORM_SAVES)

# -- pooling: max pooling's indices route the gradient; average pooling spreads it evenly. Either
# way the input is read for its shape only
_SHAPE_ONLY = "the backward reads only the input's shape"
declare("MaxPool2DWithIndicesBackward0", "MaxPool3DWithIndicesBackward0",  # max_pool1d runs the 2-D kernel
        edges=("self",), source="derivatives.yaml max_pool*d_with_indices_backward", saves={
            "self": Read(reads=Reads.SHAPE, rule="GA301",
                         unread="the backward reads only the input's shape; the indices say where the maxima were"),
            "result1": Read(why="the indices route the gradient"),
        })
declare("AdaptiveMaxPool2DBackward0", edges=("self",), source="derivatives.yaml adaptive_max_pool2d_backward",
        saves={
            "self": Read(reads=Reads.SHAPE, rule="GA301",
                         unread="the backward reads only the input's shape; the indices say where the maxima were"),
            "result1": Read(why="the indices route the gradient"),
        })
declare("AvgPool2DBackward0", "AdaptiveAvgPool2DBackward0", edges=("self",),
        source="derivatives.yaml avg_pool2d_backward / _adaptive_avg_pool2d_backward",
        saves={"self": Read(reads=Reads.SHAPE, rule="GA302", unread=_SHAPE_ONLY)})

# -- ops that read a saved tensor for its shape only
declare("GatherBackward0", edges=("self", "index"), source="derivatives.yaml gather: gather_backward",
        saves={"self": Read(reads=Reads.SHAPE, rule="GA002", unread=_SHAPE_ONLY),
               "index": Read(why="the indices route the gradient")})
declare("NllLossBackward0", edges=("self", "target", "weight"), source="derivatives.yaml nll_loss_backward",
        saves={"self": Read(reads=Reads.SHAPE, rule="GA002", unread=_SHAPE_ONLY),
               "target": Read(why="the targets pick the gradient's entries"),
               "weight": Read(why="the class weights scale the gradient"),
               "total_weight": Read(why="the reduction divides by it")})

# -- ops whose saves only some gradients read (codegen saves them whenever any is wanted)
declare("PowBackward1", edges=("self", "exponent"), source="derivatives.yaml pow.Tensor_Tensor", saves={
    "self": Read(why="read by the self and exponent gradients"),
    "exponent": Read(by=("self",), rule="GA001"),
    "result": Read(by=("exponent",), rule="GA001"),
})
declare("PowBackward2", edges=("exponent",), source="derivatives.yaml pow.Scalar: pow_backward_exponent",
        saves={"result": Read(why="read by the exponent gradient"),
               "exponent": Read(why="read by the exponent gradient", sometimes="only a base of 0 makes the "
                                "gradient depend on the exponent's sign")})
declare("PreluKernelBackward0", edges=("self", "weight"), weight="weight", source="derivatives.yaml _prelu_kernel",
        saves={"self": Read(why="read by the self and weight gradients"),
               "weight": Read(by=("self",), rule="GA102")})
declare("ScaledDotProductFlashAttentionForCpuBackward0", edges=("query", "key", "value"),
        source="derivatives.yaml _scaled_dot_product_flash_attention_for_cpu; ATen cpu/FlashAttentionKernel.cpp "
               "cpu_flash_attention_backward", saves={
            # dV = P^T dO needs only query, key and logsumexp (to recompute P); the output and
            # value enter dQ and dK (through rowsum(dO * O) and dO V^T)
            "query": Read(why="the probabilities are recomputed from it"),
            "key": Read(why="the probabilities are recomputed from it"),
            "logsumexp": Read(why="the probabilities are recomputed from it"),
            "value": Read(by=("query", "key"), rule="GA001"),
            "output": Read(by=("query", "key"), rule="GA001"),
            # saved when the caller passes one (a padded batch: every Hugging Face model with a padding
            # mask); SDPA hands a boolean mask over as a new float one, 0 where attended and -inf where
            # not. The backward recomputes P = exp(scale * Q K^T + mask - logsumexp) block by block, and
            # every gradient reads P. The mask is no gradient edge of the node: derivatives.yaml
            # differentiates query, key and value only (a mask that requires grad takes the math path)
            "attn_mask": Read(why="added to the scores when backward recomputes the probabilities, which "
                                  "every gradient reads; the mask itself gets no gradient"),
        })
# weight normalisation (nn.utils.parametrizations.weight_norm, wav2vec2's positional convolution): the
# fused kernels (dim 0 or the last dim; CPU cpu/WeightNormKernel.cpp, CUDA cuda/WeightNorm.cu, and
# _weight_norm_differentiable_backward under create_graph) compute grad_g = sum(grad * v) / norm and
# grad_v = g / norm * (grad - v * grad_g / norm): g enters the v gradient only, result1 is the norms
declare("WeightNormInterfaceBackward0", edges=("v", "g"),
        source="derivatives.yaml _weight_norm_interface; ATen WeightNorm.cpp, cpu/WeightNormKernel.cpp, cuda/WeightNorm.cu",
        saves={"v": Read(why="read by the v and g gradients"),
               "result1": Read(why="the norms, read by the v and g gradients"),
               "g": Read(by=("v",), rule="GA001")})
declare("AddcmulBackward0", edges=("self", "tensor1", "tensor2"), source="derivatives.yaml addcmul",
        saves={"tensor1": Read(by=("tensor2",), rule="GA001"), "tensor2": Read(by=("tensor1",), rule="GA001")})
# the target gradient is -grad * self (or reads only self and pos_weight): it never reads the target
declare("BinaryCrossEntropyWithLogitsBackward0", edges=("self", "target", "weight", "pos_weight"),
        source="derivatives.yaml binary_cross_entropy_with_logits", saves={
            "self": Read(why="read by the self and target gradients"),
            "target": Read(by=("self",), rule="GA001"),
            "weight": Read(why="scales both gradients"),
            "pos_weight": Read(why="scales both gradients"),
        })
declare("GridSampler2DBackward0", edges=("input", "grid"), source="derivatives.yaml grid_sampler_2d_backward",
        saves={"grid": Read(why="read by the input and grid gradients"),
               "input": Read(by=("grid",), rule="GA001")})
declare("RreluWithNoiseBackward0", edges=("self",), when={"training": True},
        source="derivatives.yaml rrelu_with_noise: in training grad * noise", saves={
            "noise": Read(why="the sampled slopes scale the gradient"),
            "self": Read(reads=Reads.NOTHING, rule="GA001", unread="in training the sampled noise alone scales "
                                                                   "the gradient"),
        })
declare("RreluWithNoiseBackward0", edges=("self",), when={"training": False},
        source="derivatives.yaml rrelu_with_noise: in eval leaky_relu_backward with the mean slope", saves={
            "noise": Read(reads=Reads.NOTHING, rule="GA001", unread="in eval mode a fixed slope is used, not the noise"),
            "self": Read(reads=Reads.SIGN, bit=Bit.GT_ZERO, rule="GA401", why="the backward reads only self > 0"),
        })

# -- activations whose backward reads one bit per element
declare("ReluBackward0", edges=("self",), source="derivatives.yaml relu: threshold_backward(grad, result, 0)",
        in_place={"relu": "result", "relu_": "result"},  # F.relu(inplace=True), Tensor.relu_
        # relu's result is never negative: result > 0 exactly where result != 0 (NaN: both pass)
        saves={"result": Read(reads=Reads.SIGN, bit=Bit.NE_ZERO, rule="GA401",
                              why="the backward reads only result > 0")})
declare("LeakyReluBackward0", edges=("self",), source="derivatives.yaml leaky_relu_backward",
        saves={"self": Read(reads=Reads.SIGN, bit=Bit.GT_ZERO, rule="GA401",
                            why="the backward reads only self > 0")})
# in-place leaky_relu_ saves its result; torch refuses a negative slope there, so result > 0
# exactly where the input was > 0: leaky_relu_backward(grad, result, slope, self_is_result=True)
declare("LeakyReluBackward1", edges=("self",), source="derivatives.yaml leaky_relu_",
        in_place={"leaky_relu": "result", "leaky_relu_": "result"},
        saves={"result": Read(reads=Reads.SIGN, bit=Bit.GT_ZERO, rule="GA401",
                              why="the backward reads only result > 0")})
declare("ThresholdBackward0", edges=("self",), when={"threshold": 0}, source="derivatives.yaml threshold_backward",
        saves={"self": Read(reads=Reads.SIGN, bit=Bit.NOT_LE_ZERO, rule="GA401",
                            why="the backward reads only self > 0")})
declare("ThresholdBackward0", edges=("self",), source="derivatives.yaml threshold_backward",
        saves={"self": Read(why="compared against the threshold")})

# -- multiplication: nn.Dropout on CPU (and wherever native_dropout is not used) multiplies by a
# float mask holding 0 and 1/(1-p); codegen saves each factor only for the other's gradient.
# In place on a view (nn.Dropout(inplace=True) after a flatten, as torchvision's efficientnet and
# mvit heads do) a dropout hides this node: ATen's in-place dropouts multiply the input by their
# noise with mul_ (the fused native_dropout serves the out-of-place call), so the one hidden save is
# the noise, read by the input gradient (checked on CPU; a path saving a mask instead would save
# one that backward reads as well). mul_ itself (``x *= mask`` on a view, Hugging Face's funnel
# attention) saves other for the self gradient and a copy of self for the other's, both read.
_DROPOUTS = ("dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "feature_dropout_", "alpha_dropout",
             "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_")
declare("MulBackward0", edges=("self", "other"), source="derivatives.yaml mul.Tensor; ATen Dropout.cpp dropout_",
        in_place={**dict.fromkeys(_DROPOUTS, "other"), "mul_": ("self", "other")}, saves={
            "self": Read(why="read by the gradient of the other factor"),
            "other": Read(reads=Reads.MASK, only_in=DROPOUT_MODULES, rule="GA402",
                          why="read by the gradient of the other factor"),
        })

# -- CUDA's dropout in training (Dropout.cpp: out-of-place F.dropout with 0 < p < 1 on a CUDA tensor runs
# the fused native_dropout; gradaudit/meta.py builds it on meta for target="cuda"): the node saves only
# the keep-mask, as bool (one byte per element), and the input gradient is grad * mask * 1/(1-p)
declare("NativeDropoutBackward0", edges=("input",),
        source="derivatives.yaml native_dropout: native_dropout_backward(grad, result1, scale)",
        saves={"result1": Read(reads=Reads.BOOL, rule="GA403",
                               why="the keep-mask says which elements of the gradient pass")})

# -- matrix products: codegen saves each operand only when the other's gradient is wanted
_MATMUL_WHY = "read by the gradient formula of an input that needs a gradient"
declare("AddmmBackward0", edges=("self", "mat1", "mat2"), weight="mat2", source="derivatives.yaml addmm",
        saves={"mat1": Read(witness="mat2", why=_MATMUL_WHY), "mat2": Read(witness="mat1", why=_MATMUL_WHY)})
declare("MmBackward0", "BmmBackward0", edges=("self", "mat2"), weight="mat2", source="derivatives.yaml mm/bmm",
        saves={"self": Read(witness="mat2", why=_MATMUL_WHY), "mat2": Read(witness="self", why=_MATMUL_WHY)})
# mixture-of-experts layers: one matrix product per group of rows (torch._grouped_mm); codegen guards
# its saves as for mm (checked: self is saved only when mat2 needs a gradient, and the reverse)
declare("GroupedMmBackward0", edges=("self", "mat2", "bias"), source="derivatives.yaml _grouped_mm",
        saves={"self": Read(witness="mat2", why=_MATMUL_WHY), "mat2": Read(witness="self", why=_MATMUL_WHY),
               "offs": Read(why="the group boundaries: each gradient is computed group by group")})
declare("LinearBackward0", edges=("input", "weight", "bias"), weight="weight", source="derivatives.yaml linear",
        saves={"input": Read(why=_MATMUL_WHY), "weight": Read(why=_MATMUL_WHY)})

# -- in-place activations: called in place on a view (nn.ReLU6(inplace=True) and the like after a
# Linear given a 3-D input, x[:, :k].sigmoid_()), each of these functions creates the node named here
# hidden inside CopySlices; its one save is read like the out-of-place op's. Where the formula reads
# the input, the in-place op saves a copy of it made before it is overwritten (tests/test_hidden_saves.py).
def _in_place_activation(name: str, attr: str, functions: Sequence[str], source: str) -> None:
    declare(name, edges=("self",), source=source, saves={attr: Read(why=_MATMUL_WHY)},
            in_place=dict.fromkeys(functions, attr))


_in_place_activation("SiluBackward0", "self", ("silu", "silu_"), "derivatives.yaml silu: silu_backward(grad, self)")
_in_place_activation("MishBackward0", "self", ("mish", "mish_"), "derivatives.yaml mish: mish_backward(grad, self)")
_in_place_activation("HardswishBackward0", "self", ("hardswish", "hardswish_"),
                     "derivatives.yaml hardswish: hardswish_backward(grad, self)")
_in_place_activation("HardsigmoidBackward0", "self", ("hardsigmoid", "hardsigmoid_"),
                     "derivatives.yaml hardsigmoid: hardsigmoid_backward(grad, self)")
_in_place_activation("HardtanhBackward0", "self", ("hardtanh", "hardtanh_", "relu6"),  # relu6_ is hardtanh_(0, 6)
                     "derivatives.yaml hardtanh: hardtanh_backward(grad, self, min_val, max_val)")
_in_place_activation("SigmoidBackward0", "result", ("sigmoid_",),
                     "derivatives.yaml sigmoid: sigmoid_backward(grad, result)")
_in_place_activation("TanhBackward0", "result", ("tanh_",), "derivatives.yaml tanh: tanh_backward(grad, result)")
# elu_ (and selu_, elu_ with fixed constants) and celu_ save their result: elu_backward(..., is_result=True, result)
# reads its values below 0 (grad * input_scale * (result + alpha * scale))
_in_place_activation("EluBackward1", "result", ("elu", "elu_", "selu", "selu_"),
                     "derivatives.yaml elu_: elu_backward(grad, alpha, scale, input_scale, true, result)")
_in_place_activation("CeluBackward1", "result", ("celu", "celu_"),
                     "derivatives.yaml celu_: elu_backward(grad, alpha, 1, 1/alpha, true, result)")
# F.threshold (whose function is named _threshold) with inplace=True, and threshold_
declare("ThresholdBackward1", edges=("self",), in_place={"_threshold": "self", "threshold_": "self"},
        source="derivatives.yaml threshold_: threshold_backward(grad, self, threshold)",
        saves={"self": Read(why="the input before it was overwritten, compared against the threshold")})

# -- indexed assignment: x[mask] = v runs index_put_ (never accumulating), whose self gradient
# (grad.index_put(indices, 0)) and values gradient (grad.index(indices)) both read the indices; on a
# view (wav2vec2's time masking in training) it hides inside CopySlices. Accumulating index_put_
# reads them for the values gradient only: not declared. torch 2.15 runs a scalar assignment through
# a bool mask as masked_fill_ and through an integer index as index_fill_ (seen on 2.15.0: x[mask] = 0
# makes MaskedFillBackward0, x[idx] = 0 IndexFillBackward0; a tensor value still index_put_), whose
# self gradients (grad.masked_fill(mask, 0), grad.index_fill(dim, index, 0)) read the mask / index.
declare("IndexPutBackward0", edges=("self", "values"), when={"accumulate": False},
        source="derivatives.yaml index_put_ (accumulate=False)", in_place={"__setitem__": "indices"},
        saves={"indices": Read(why="the indices say which elements were overwritten")})
declare("MaskedFillBackward0", edges=("self",), in_place={"__setitem__": "mask"},
        source="derivatives.yaml masked_fill.Scalar: self: grad.masked_fill(mask, 0)",
        saves={"mask": Read(why="the mask says which elements were overwritten")})
declare("IndexFillBackward0", edges=("self",), in_place={"__setitem__": "index"},
        source="derivatives.yaml index_fill.int_Scalar: self: grad.index_fill(dim, index, 0)",
        saves={"index": Read(why="the index says which elements were overwritten")})

# Ops whose every save is read by the gradient formula of an input that needs a gradient:
# PyTorch's codegen saves each tensor only when such a formula needs it (single-output derivative
# formulas). Reviewed one by one against derivatives.yaml; extend only after checking with verify=True.
declare(
    "AddbmmBackward0", "BaddbmmBackward0",
    "DivBackward0", "PowBackward0",
    "SoftmaxBackward0", "SafeSoftmaxBackward0", "LogSoftmaxBackward0", "GeluBackward0",
    "EluBackward0", "SoftplusBackward0", "ExpBackward0", "LogBackward0",
    "SqrtBackward0", "RsqrtBackward0", "SinBackward0", "CosBackward0",
    "EmbeddingBackward0", "IndexBackward0", "MeanBackward1", "NormBackward1",
    "ScaledDotProductEfficientAttentionBackward0", "ScaledDotProductFlashAttentionBackward0",
    "ScaledDotProductCudnnAttentionBackward0",
    "MseLossBackward0", "LinalgVectorNormBackward0", "ReciprocalBackward0", "NegBackward0",
    "AbsBackward0", "ClampBackward1", "ClampMinBackward0", "ClampMaxBackward0", "WhereBackward0",
    "MaxBackward0", "MinBackward0", "MaxBackward1", "MinBackward1",
    "UpsampleNearest2DBackward0", "ErfBackward0",
    "ProdBackward0", "ProdBackward1", "CumsumBackward0", "VarMeanBackward0", "StdMeanBackward0",
    "SliceBackward0", "SelectBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "SoftmaxBackwardDataBackward0", "TopkBackward0", "SortBackward0",
    # smooth_l1_loss_backward(grad, self, target) and (grad, target, self) read both; index_select's
    # gradient scatters by the index; maximum/minimum compare self with other for either gradient
    "SmoothL1LossBackward0", "IndexSelectBackward0", "MaximumBackward0", "MinimumBackward0",
    edges=(), default=Read(why=_MATMUL_WHY), source="derivatives.yaml (single-output formulas, guarded saves)",
)
