"""The rule catalogue. Codes: GA + 3 digits; the hundreds digit names the family.

0xx catch-all and blind spots   1xx convolution      2xx normalisation   3xx pooling
4xx compressible saves          5xx leaf gradients   6xx views/storage   7xx dtype casts
8xx attention                   9xx checkpointing hygiene
"""

from __future__ import annotations

from typing import Iterator

from ..records import NOT_NEEDED, SIGN_ONLY
from .registry import Flag, RuleContext, rule


def _not_needed(ctx: RuleContext, node_names: tuple[str, ...], attrs: tuple[str, ...]) -> Iterator[tuple]:
    for node in ctx.nodes_named(*node_names):
        saved = ctx.saved(node)
        hits = [saved[a] for a in attrs if a in saved and saved[a].verdict == NOT_NEEDED
                and saved[a].managed_by == "autograd" and saved[a].storage_kind in ("activation", "output")]
        if hits:
            yield node, hits


@rule("GA101", "conv-input-saved-for-frozen-weight",
      fix="Drop the saved input while the weight is frozen (gradaudit.trim)",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model):        # keeps only what backward needs
            loss = model(x).sum()
            loss.backward()
      """)
def conv_input_saved_for_frozen_weight(ctx: RuleContext):
    """Convolution keeps its input for backward although its weight needs no gradient.

    What it flags:
        Conv1d/2d/3d and ConvTranspose1d/2d/3d (module or functional form) whose weight does not
        require grad while the input still needs a gradient (something trainable sits upstream, or
        the input itself is differentiated).
    Why it costs memory:
        PyTorch derives all convolution gradients from one multi-output formula, so it saves the
        input whenever any gradient is required. The input is read only by the weight gradient
        (pytorch/pytorch#133566).
    Example:
        backbone.requires_grad_(False); backbone.layer4.requires_grad_(True)
        # every frozen conv between the input and layer4 saves its input
    Fix:
        Run the step under ``gradaudit.trim(model)``: the saved input is replaced by an empty
        placeholder as the forward proceeds. Or give the layer a custom autograd.Function that
        saves only the weight.
    Fix safety:
        Gradients are bit-identical: the dropped tensor is never read.
    Known limits:
        If the same storage is also saved by a node that needs it (the previous ReLU's result),
        dropping it alone frees nothing; the finding's ``bytes`` says so and ``bytes_together``
        counts it once every fix (bit-packing included) is applied.
    """
    for node, hits in _not_needed(ctx, ("ConvolutionBackward0",), ("input",)):
        shape = "x".join(map(str, hits[0].shape))
        yield Flag(node, hits, f"{node.module or 'model'} ({hits[0].module_class}) saves its {shape} "
                               f"input for a weight gradient nobody asked for")


@rule("GA102", "conv-weight-saved-for-frozen-input",
      fix="Drop the saved weight while the input needs no gradient (gradaudit.trim)",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model):
            model(x).sum().backward()
      """)
def conv_weight_saved_for_frozen_input(ctx: RuleContext):
    """Convolution keeps a computed weight although its input needs no gradient.

    What it flags:
        Convolutions whose input needs no gradient (typically the first layer) and whose saved
        weight is not a parameter: a weight computed in the forward (weight normalisation,
        merged LoRA adapters, a dtype cast). A plain parameter costs nothing and is not flagged.
    Why it costs memory:
        The weight is read only by the input gradient; a computed weight lives only because
        autograd saved it.
    Example:
        conv = torch.nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 64, 3))
        conv(images)  # images.requires_grad is False: the normalised weight is held for nothing
    Fix:
        ``gradaudit.trim(model)``, or compute the weight once outside the step if it is frozen.
    Fix safety:
        Gradients are bit-identical: the dropped tensor is never read.
    Known limits:
        Only the weight's own storage is counted; it is freed only if nothing else holds it.
    """
    for node, hits in _not_needed(ctx, ("ConvolutionBackward0",), ("weight",)):
        hits = [t for t in hits if t.storage_kind in ("activation", "output")]
        if hits:
            yield Flag(node, hits, f"{node.module or 'model'} saves a computed weight "
                                   f"({'x'.join(map(str, hits[0].shape))}) that only the input gradient "
                                   f"reads, and the input needs no gradient")


@rule("GA201", "batchnorm-eval-saves-input",
      fix="Drop batch norm's saved input in eval mode with frozen affine (gradaudit.trim)",
      fix_code="""
        import gradaudit
        model.eval()                      # batch norm uses running statistics
        with gradaudit.trim(model):
            model(x).sum().backward()
      """)
def batchnorm_eval_saves_input(ctx: RuleContext):
    """Batch norm in eval mode keeps its input although its weight needs no gradient.

    What it flags:
        BatchNorm1d/2d/3d (and F.batch_norm) running with training=False whose weight needs no
        gradient (frozen or affine=False): the saved input, running mean and the (empty) batch
        statistics.
    Why it costs memory:
        In eval mode the input gradient is grad * weight / sqrt(running_var + eps): it never
        reads the input. PyTorch's single multi-output formula saves it anyway.
    Example:
        model.eval(); model.requires_grad_(False); x.requires_grad_(True)   # adversarial attack
    Fix:
        ``gradaudit.trim(model)``; or fold the frozen batch norm into the preceding convolution.
    Fix safety:
        Gradients are bit-identical: the dropped tensors are never read.
    Known limits:
        In train mode the input is needed (batch statistics) and nothing is flagged. The input is
        often also the previous convolution's output kept by another node; bytes say so.
    """
    for node, hits in _not_needed(ctx, ("NativeBatchNormBackward0",),
                                  ("input", "running_mean", "result1", "result2")):
        if any(t.attr == "input" for t in hits):
            yield Flag(node, hits, f"{node.module or 'model'} (batch norm, eval mode) saves its input "
                                   f"although the weight needs no gradient")


@rule("GA301", "maxpool-saves-input",
      fix="Keep only max-pooling's indices (gradaudit.trim)",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model):
            model(x).sum().backward()
      """)
def maxpool_saves_input(ctx: RuleContext):
    """Max-pooling keeps its whole input although backward reads only the indices.

    What it flags:
        MaxPool1d/2d/3d and F.max_pool*d: the saved input (``self``) of the with-indices kernel.
    Why it costs memory:
        The backward scatters the gradient to the saved argmax indices; it reads the input only
        for its shape.
    Example:
        nn.Sequential(nn.Conv2d(3, 64, 7), nn.ReLU(), nn.MaxPool2d(3, 2))   # torchvision stems
    Fix:
        ``gradaudit.trim(model)`` replaces the saved input by a zero-stride placeholder.
    Fix safety:
        Gradients are bit-identical: the values are never read.
    Known limits:
        After a ReLU the input is the ReLU's result, which the ReLU also saves: dropping it frees
        memory only together with bit-packing the ReLU's result (see ``bytes_together``).
    """
    for node, hits in _not_needed(ctx, ("MaxPool1DWithIndicesBackward0", "MaxPool2DWithIndicesBackward0",
                                        "MaxPool3DWithIndicesBackward0"), ("self",)):
        yield Flag(node, hits, f"{node.module or 'model'} saves its whole "
                               f"{'x'.join(map(str, hits[0].shape))} input; backward reads only the indices")


@rule("GA401", "sign-only-save-kept-as-float",
      fix="Keep a 1-bit sign mask instead of the float tensor (gradaudit.trim(bitpack=True))",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model, bitpack=True):
            model(x).sum().backward()
      """)
def sign_only_save_kept_as_float(ctx: RuleContext):
    """An activation keeps a float tensor although backward reads only its sign.

    What it flags:
        ReLU results, LeakyReLU inputs and threshold(x, 0, v) inputs saved for backward.
    Why it costs memory:
        The gradient is grad * (t > 0) (or a slope where t <= 0): one bit per element would do,
        a float32 tensor takes 32.
    Example:
        nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    Fix:
        ``gradaudit.trim(model, bitpack=True)`` stores the sign pattern packed 8 per byte.
    Fix safety:
        Gradients are bit-identical: the backward reads only the sign.
    Known limits:
        Often the same tensor is the next layer's saved input; memory is freed only if that
        save can be dropped too (frozen next layer) - otherwise ``bytes`` is 0.
    """
    for node in ctx.nodes_named("ReluBackward0", "LeakyReluBackward0", "ThresholdBackward0"):
        hits = [t for t in ctx.saved(node).values() if t.verdict == SIGN_ONLY and t.managed_by == "autograd"
                and t.storage_kind in ("activation", "output")]
        if hits:
            yield Flag(node, hits, f"{node.module or 'model'} keeps a "
                                   f"{hits[0].dtype} tensor of {'x'.join(map(str, hits[0].shape))} "
                                   f"where backward reads only its sign")
