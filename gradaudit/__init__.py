"""gradaudit: find the memory PyTorch autograd holds for backward that backward can never use."""

from .audit import audit
from .errors import ForwardError, GradauditError, NothingRequiresGradError
from .records import SCHEMA_VERSION, Finding, Report, SavedTensor

__version__ = "0.1.0"

__all__ = [
    "audit", "Report", "Finding", "SavedTensor", "SCHEMA_VERSION",
    "GradauditError", "ForwardError", "NothingRequiresGradError", "__version__",
]
