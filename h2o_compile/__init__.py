"""h2o_compile: H2O (Heavy-Hitter Oracle) KV-cache eviction for Hugging Face causal LMs, as a compiler pass."""

from . import ops  # noqa: F401  (registers torch.ops.h2o.*)
from .config import H2OConfig, ScoreRule
from .export import H2OOrtModel, export_onnx
from .presets import PRESETS
from .runtime import H2OModel, optimize
from . import zoo
from .support import UnsupportedModelError
from .zoo import load_gemma3_270m, load_tiny

__all__ = ["H2OConfig", "H2OModel", "H2OOrtModel", "PRESETS", "ScoreRule", "UnsupportedModelError", "export_onnx",
           "load_gemma3_270m", "load_tiny", "optimize", "zoo"]
__version__ = "0.1.0"
