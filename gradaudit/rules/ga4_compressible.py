"""GA4xx: saves kept as floats or bytes whose information is one bit per element (signs, dropout masks)."""

from __future__ import annotations

from ..records import NEEDED, SIGN_ONLY, GraphNode, SavedTensor
from .registry import claims_rule
from .shared import shape_text


@claims_rule("GA401", "sign-only-save-kept-as-float", SIGN_ONLY,
      fix="Keep a 1-bit sign mask instead of the float tensor (gradaudit.trim(model, masks=\"bits\"))",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model, masks="bits"):
            model(x).sum().backward()
      """)
def sign_only_save_kept_as_float(node: GraphNode, hits: list[SavedTensor]) -> str:
    """An activation keeps a float tensor although backward reads only its sign.

    What it flags:
        ReLU results, LeakyReLU inputs and threshold(x, 0, v) inputs saved for backward.
    Why it costs memory:
        The gradient is grad * (t > 0) (or a slope where t <= 0): one bit per element would do,
        a float32 tensor takes 32.
    Example:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
        report = gradaudit.audit(model, torch.randn(8, 16))
    Fix:
        ``gradaudit.trim(model, masks="bits")`` stores the sign pattern packed 8 per byte.
        ``gradaudit.trim(model)`` (``masks="auto"``) does so on the CPU; on a GPU it keeps a bool
        per element instead (75% of a float32 save freed, one kernel each way, where bits take more).
    Fix safety:
        Gradients are bit-identical: the backward reads only the sign.
    Known limits:
        Often the same tensor is the next layer's saved input; memory is freed only if that
        save can be dropped too (frozen next layer) - otherwise ``bytes`` is 0.
    """
    return (f"{node.module or 'model'} keeps a {hits[0].dtype} tensor of {shape_text(hits[0])} where backward "
            f"reads only its sign")


@claims_rule("GA402", "dropout-mask-saved-as-float", NEEDED, bitpackable=True, each=True,
      fix="Keep dropout's mask as bits (gradaudit.trim(model, masks=\"bits\")): gradients stay bit-identical",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model, masks="bits"):   # the 0 / 1/(1-p) mask kept as 1 bit per element
            model(x).sum().backward()
      """)
def dropout_mask_saved_as_float(node: GraphNode, hits: list[SavedTensor]) -> str:
    """Dropout keeps its keep-mask as a float tensor although it holds only two values.

    What it flags:
        nn.Dropout/Dropout1d/2d/3d running in training mode where PyTorch implements dropout as
        ``input * mask`` (on CPU, and wherever the fused native_dropout is not used): the
        MulBackward0 node saves ``other``, a float mask holding only 0 and 1/(1-p).
    Why it costs memory:
        The mask has the input's size and dtype (32 bits per element in float32); its information
        is one bit per element.
    Example:
        model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Linear(32, 10)).train()
        report = gradaudit.audit(model, torch.randn(8, 16))   # on CPU dropout runs as input * mask
    Fix:
        Bit-pack the saved mask (``gradaudit.trim(model, masks="bits")``, the snippet; ``masks="auto"``,
        the default, keeps a bool per element on a GPU). Or, in your
        own code, a dropout that saves a bool mask: ``keep = torch.rand_like(x) >= p`` then
        ``torch.where(keep, x / (1 - p), 0.0)`` (``torch.where`` saves only its bool condition).
    Fix safety:
        Bit-packing is bit-identical. The ``torch.where`` rewrite draws its random numbers
        differently and rounds ``x / (1 - p)`` once instead of ``x * mask``: not bit-identical.
    Known limits:
        Recognised by module class (Dropout*) and the node (MulBackward0 ``other``); with
        verify=True the two-valuedness is checked on the actual mask.
    """
    mask = hits[0]
    return (f"{node.module or 'model'} ({mask.module_class}) keeps a {mask.dtype} dropout mask of "
            f"{shape_text(mask)} that holds only two values")


@claims_rule("GA403", "dropout-mask-saved-as-bytes", NEEDED, bitpackable=True, each=True,
      fix="Keep the bool keep-mask as bits (gradaudit.trim(model, masks=\"bits\")): gradients stay "
          "bit-identical",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model, masks="bits"):   # each bool of the keep-mask kept as 1 bit
            model(x).sum().backward()
      """)
def dropout_mask_saved_as_bytes(node: GraphNode, hits: list[SavedTensor]) -> str:
    """Fused dropout keeps its keep-mask as bool, one byte per element for one bit of information.

    What it flags:
        ``native_dropout``'s node (NativeDropoutBackward0) saving ``result1``, its bool keep-mask: the
        dropout every CUDA ``nn.Dropout`` / ``F.dropout`` runs in training (Dropout.cpp sends an
        out-of-place dropout with 0 < p < 1 on a CUDA tensor to it; ``target="cuda"`` on meta
        emulates that), and any direct ``torch.native_dropout`` call (decompositions, some libraries).
    Why it costs memory:
        A bool takes a byte; the backward, ``grad * mask * 1/(1-p)``, reads one bit of it per element.
        A BERT keeps three such masks per layer (attention probabilities, attention output,
        feed-forward output), the first of batch x heads x length x length elements.
    Example:
        with torch.device("meta"):   # audited as a GPU would run it
            model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Linear(32, 10)).train()
        report = gradaudit.audit(model, torch.randn(8, 16, device="meta"), target="cuda")
    Fix:
        ``gradaudit.trim(model, masks="bits")`` keeps the mask packed 8 elements per byte and gives
        backward the same bools; ``masks="bytes"``, and ``"auto"`` (the default) on a GPU, leave it as
        it is.
    Fix safety:
        Bit-identical: a bool holds one of two values, which the bits keep exactly.
    Known limits:
        Packing and unpacking are two elementwise operations each way on a GPU (see docs/trim.md for
        what they cost against the bytes they free).
    """
    mask = hits[0]
    return (f"{node.module or 'model'} ({mask.module_class}) keeps a bool dropout mask of {shape_text(mask)}, "
            f"a byte per element for one bit")
