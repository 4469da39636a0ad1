"""GA2xx: normalisation keeps its input for gradients nobody wants (eval-mode batch norm, bias-only
tuning)."""

from __future__ import annotations

from ..records import NOT_NEEDED, GraphNode, SavedTensor
from .registry import claims_rule


@claims_rule("GA201", "batchnorm-eval-saves-input", NOT_NEEDED,
      when=lambda hits: any(t.attr == "input" for t in hits),
      fix="Drop batch norm's saved input in eval mode with frozen affine (gradaudit.trim)",
      fix_code="""
        import gradaudit
        model.eval()                      # batch norm uses running statistics
        with gradaudit.trim(model):
            model(x).sum().backward()
      """)
def batchnorm_eval_saves_input(node: GraphNode, hits: list[SavedTensor]) -> str:
    """Batch norm in eval mode keeps its input although its weight needs no gradient.

    What it flags:
        BatchNorm1d/2d/3d (and F.batch_norm) running with training=False whose weight needs no
        gradient (frozen or affine=False): the saved input, running mean and the (empty) batch
        statistics, for the native kernel and for cuDNN's (CUDA; ``target="cuda"`` on meta), whose
        eval-mode backward is the same call.
    Why it costs memory:
        In eval mode the input gradient is grad * weight / sqrt(running_var + eps): it never
        reads the input. PyTorch's single multi-output formula saves it anyway.
    Example:
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 10, 1))
        model.eval(); model.requires_grad_(False)
        x = torch.randn(2, 3, 16, 16, requires_grad=True)   # adversarial attack: only x.grad is wanted
        report = gradaudit.audit(model, x)
    Fix:
        ``gradaudit.trim(model)``; or fold the frozen batch norm into the preceding convolution.
    Fix safety:
        Gradients are bit-identical: the dropped tensors are never read.
    Known limits:
        In train mode the input is needed (batch statistics) and nothing is flagged. The input is
        often also the previous convolution's output kept by another node; bytes say so.
    """
    return f"{node.module or 'model'} (batch norm, eval mode) saves its input although the weight needs no gradient"


@claims_rule("GA202", "norm-saves-input-for-bias-only", NOT_NEEDED, when=lambda hits: any(t.numel for t in hits),
      fix="Drop what normalisation saves for the input and weight gradients when only its bias trains (gradaudit.trim)",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model):        # BitFit-style bias-only tuning keeps no norm inputs
            model(x).sum().backward()
      """)
def norm_saves_input_for_bias_only(node: GraphNode, hits: list[SavedTensor]) -> str:
    """Normalisation keeps its input and statistics although only its bias needs a gradient.

    What it flags:
        Batch norm in training mode, layer norm and group norm whose input and weight need no
        gradient while the bias does: the saved input, mean and inverse standard deviation (and
        layer norm's saved bias, which no formula reads). In bias-only tuning (BitFit) that is the
        first norm whose input needs no gradient, e.g. right after a frozen embedding; later norms
        get inputs that need a gradient (upstream biases train) and must keep them.
    Why it costs memory:
        The bias gradient is the sum of the incoming gradient: it reads nothing saved. PyTorch's
        multi-output formula saves the input whenever any gradient is wanted.
    Example:
        model = nn.Sequential(nn.Embedding(100, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("bias"))   # bias-only tuning (BitFit)
        ids = torch.randint(0, 100, (4, 8))
        report = gradaudit.audit(model, ids)   # the LayerNorm keeps its input, mean and 1/std anyway
    Fix:
        ``gradaudit.trim(model)`` drops those saves as the forward proceeds.
    Fix safety:
        Gradients are bit-identical: the dropped tensors are never read.
    Known limits:
        The input is often also kept by another node (the previous linear layer's saved output,
        when that layer's weight trains); bytes say so. cuDNN's training-mode batch norm (CUDA,
        ``target="cuda"``) is not flagged: its backward computes every gradient in one call from
        every save, and no proof on a GPU has shown what it leaves unread.
    """
    return (f"{node.module or 'model'} ({hits[0].module_class}) saves {', '.join(t.attr for t in hits)} that only "
            f"the input and weight gradients read, and neither is wanted")
