"""gradaudit: find the memory PyTorch autograd holds for backward that backward can never use."""

from .audit import audit
from .errors import ForwardError, GradauditError, NothingRequiresGradError
from .records import SCHEMA_VERSION, Finding, Report, SavedTensor
from .trimming import trim
from .testing import assert_no_waste

__version__ = "0.1.0"

__all__ = [
    "audit", "trim", "Report", "Finding", "SavedTensor", "SCHEMA_VERSION",
    "GradauditError", "ForwardError", "NothingRequiresGradError", "assert_no_waste", "__version__",
]
