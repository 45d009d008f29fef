"""h2o_compile: H2O (Heavy-Hitter Oracle) KV-cache eviction for Hugging Face causal LMs, as a compiler pass."""

from . import ops  # noqa: F401  (registers torch.ops.h2o.*)
from .config import H2OConfig
from .runtime import H2OModel, optimize
from .support import UnsupportedModelError

__all__ = ["H2OConfig", "H2OModel", "UnsupportedModelError", "optimize"]
__version__ = "0.1.0"
