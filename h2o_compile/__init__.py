"""h2o_compile: H2O (Heavy-Hitter Oracle) KV-cache eviction for Hugging Face causal LMs, as a compiler pass."""

from . import ops  # noqa: F401  (registers torch.ops.h2o.*)
from .config import H2OConfig

__all__ = ["H2OConfig", "ops"]
__version__ = "0.1.0"
