"""h2o_compile: H2O (Heavy-Hitter Oracle) KV-cache eviction for Hugging Face causal LMs, as a compiler pass.

The layers, each importing only those before it (tests/test_layers.py): ``kernels`` (the math) <- ``config``
<- ``ops`` (the op boundary) <- ``graph`` (capture and passes) <- ``runtime`` (H2OModel) <- ``export`` <-
``bench``, ``quality``, ``integrations`` <- ``cli``; ``zoo`` and ``reporting`` stand apart.
"""

from .config import PRESETS, H2OConfig, ScoreRule
from .export import H2OOrtModel, export_onnx
from .graph.support import UnsupportedModelError
from .integrations import CUSTOM_GENERATE
from .runtime import H2OModel, calibrate, optimize
from . import zoo
from .zoo import load_gemma3_270m, load_tiny

__all__ = ["CUSTOM_GENERATE", "H2OConfig", "H2OModel", "H2OOrtModel", "PRESETS", "ScoreRule", "UnsupportedModelError",
           "calibrate", "export_onnx", "load_gemma3_270m", "load_tiny", "optimize", "zoo"]
__version__ = "0.1.0"
