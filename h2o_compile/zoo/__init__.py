"""Models that run offline.

``load_gemma3_270m()`` returns Gemma 3 270M from its PyPI weight packages (the ``gemma`` extra; see
:mod:`h2o_compile.zoo.gemma`). ``load_tiny()`` returns the tiny Llama trained by
``benchmarks/train_tiny_lm.py`` (recipe in :mod:`h2o_compile.zoo.train`, model card in
``h2o_compile/assets/tiny-llama/README.md``), loaded from the package folder. No network, no model hub.
"""

from __future__ import annotations

from .gemma import gemma3_270m_path, load_gemma3_270m, load_gguf
from .loading import MODELS, TINY_LLAMA_DIR, load_pretrained, load_model, load_tiny, model_name

__all__ = ["MODELS", "TINY_LLAMA_DIR", "gemma3_270m_path", "load_gemma3_270m", "load_gguf", "load_pretrained",
           "load_model", "load_tiny", "model_name"]
