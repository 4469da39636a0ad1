"""The rule catalogue. Codes: GA + 3 digits; the hundreds digit names the family.

0xx catch-all, shape-only and unwanted-gradient saves   1xx convolution      2xx normalisation   3xx pooling
4xx compressible saves          5xx leaf gradients   6xx views/storage   7xx copies (casts, layouts)
8xx attention                   9xx checkpointing hygiene
"""

# one module per family, each with its doc line; importing them registers their rules
from . import (ga0_any_op, ga1_convolution, ga2_normalisation, ga3_pooling, ga4_compressible,  # noqa: F401
               ga5_leaf_gradients, ga6_views, ga7_casts, ga8_attention, ga9_checkpointing)
