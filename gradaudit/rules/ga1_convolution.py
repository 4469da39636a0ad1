"""GA1xx: convolution keeps a tensor only a gradient nobody wants would read."""

from __future__ import annotations

from ..records import NOT_NEEDED, GraphNode, SavedTensor
from .registry import claims_rule
from .shared import TRIM_SNIPPET, shape_text


@claims_rule("GA101", "conv-input-saved-for-frozen-weight", NOT_NEEDED,
      fix="Drop the saved input while the weight is frozen (gradaudit.trim)",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model):        # keeps only what backward needs
            loss = model(x).sum()
            loss.backward()
      """)
def conv_input_saved_for_frozen_weight(node: GraphNode, hits: list[SavedTensor]) -> str:
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
        model = torchvision.models.resnet18(num_classes=10)
        model.requires_grad_(False); model.layer1.requires_grad_(True)   # fine-tune an early layer only
        # every frozen conv in layer2 to layer4 saves its input for a weight gradient nobody asked for
        report = gradaudit.audit(model, torch.randn(1, 3, 64, 64))
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
    return (f"{node.module or 'model'} ({hits[0].module_class}) saves its {shape_text(hits[0])} "
            f"input for a weight gradient nobody asked for")


@claims_rule("GA102", "conv-weight-saved-for-frozen-input", NOT_NEEDED,
      fix="Drop the saved weight while the input needs no gradient (gradaudit.trim)",
      fix_code=TRIM_SNIPPET)
def conv_weight_saved_for_frozen_input(node: GraphNode, hits: list[SavedTensor]) -> str:
    """Convolution (or normalisation, PReLU) keeps a computed weight although its input needs no gradient.

    What it flags:
        Convolutions, batch/layer/group norm and PReLU whose input needs no gradient (typically the
        first layer) and whose saved weight is not a parameter: a weight computed in the forward (weight normalisation,
        merged LoRA adapters, a dtype cast). A plain parameter costs nothing and is not flagged.
    Why it costs memory:
        The weight is read only by the input gradient; a computed weight lives only because
        autograd saved it.
    Example:
        conv = torch.nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 8, 3))
        images = torch.randn(2, 3, 16, 16)   # needs no gradient: the normalised weight is held for nothing
        report = gradaudit.audit(conv, images)
    Fix:
        ``gradaudit.trim(model)``, or compute the weight once outside the step if it is frozen.
    Fix safety:
        Gradients are bit-identical: the dropped tensor is never read.
    Known limits:
        Only the weight's own storage is counted; it is freed only if nothing else holds it.
    """
    return (f"{node.module or 'model'} saves a computed weight ({shape_text(hits[0])}) that only the input "
            f"gradient reads, and the input needs no gradient")
