"""GA3xx: pooling keeps its whole input although backward reads only indices or the shape."""

from __future__ import annotations

from ..records import NOT_NEEDED, GraphNode, SavedTensor
from .registry import claims_rule
from .shared import TRIM_SNIPPET, shape_text


@claims_rule("GA301", "maxpool-saves-input", NOT_NEEDED,
      fix="Keep only max-pooling's indices (gradaudit.trim)",
      fix_code=TRIM_SNIPPET)
def maxpool_saves_input(node: GraphNode, hits: list[SavedTensor]) -> str:
    """Max-pooling keeps its whole input although backward reads only the indices.

    What it flags:
        MaxPool1d/2d/3d, AdaptiveMaxPool2d and F.max_pool*d: the saved input (``self``) of the
        with-indices kernel.
    Why it costs memory:
        The backward scatters the gradient to the saved argmax indices; it reads the input only
        for its shape.
    Example:
        model = nn.Sequential(nn.Conv2d(3, 8, 7), nn.ReLU(), nn.MaxPool2d(3, 2))   # torchvision stems
        report = gradaudit.audit(model, torch.randn(2, 3, 32, 32))
    Fix:
        ``gradaudit.trim(model)`` replaces the saved input by a zero-stride placeholder.
    Fix safety:
        Gradients are bit-identical: the values are never read.
    Known limits:
        After a ReLU the input is the ReLU's result, which the ReLU also saves: dropping it frees
        memory only together with bit-packing the ReLU's result (see ``bytes_together``).
    """
    return f"{node.module or 'model'} saves its whole {shape_text(hits[0])} input; backward reads only the indices"


@claims_rule("GA302", "avgpool-saves-input", NOT_NEEDED,
      fix="Keep nothing of average pooling's input (gradaudit.trim)",
      fix_code=TRIM_SNIPPET)
def avgpool_saves_input(node: GraphNode, hits: list[SavedTensor]) -> str:
    """Average pooling keeps its whole input although backward reads only its shape.

    What it flags:
        AvgPool2d, AdaptiveAvgPool2d and their functional forms: the saved input (``self``).
    Why it costs memory:
        The backward spreads each output gradient evenly over its window; the window sizes follow
        from the input's shape, never from its values.
    Example:
        # (AdaptiveAvgPool2d(1) would run as a mean, which keeps nothing)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10))
        report = gradaudit.audit(model, torch.randn(2, 3, 16, 16))
    Fix:
        ``gradaudit.trim(model)`` replaces the saved input by a placeholder of its shape.
    Fix safety:
        Gradients are bit-identical: the values are never read.
    Known limits:
        ``AdaptiveAvgPool2d(1)`` (global pooling) runs as a mean, which keeps nothing: not flagged.
        After a ReLU the input is the ReLU's result, which the ReLU also saves: dropping it frees
        memory only together with bit-packing the ReLU's result (see ``bytes_together``).
    """
    return f"{node.module or 'model'} saves its whole {shape_text(hits[0])} input; backward reads only its shape"
