"""Models that run offline.

``load_gemma3_270m()`` returns Gemma 3 270M from its PyPI weight packages (the ``gemma`` extra; see
:mod:`h2o_compile.zoo.gemma`). ``load_tiny()`` returns the tiny Llama trained by
``benchmarks/train_tiny_lm.py`` (recipe in :mod:`h2o_compile.zoo.train`, model card in
``h2o_compile/assets/tiny-llama/README.md``), loaded from the package folder. No network, no model hub.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .gemma import gemma3_270m_path, load_gemma3_270m, load_gguf
from .loading import load_local, model_name

TINY_LLAMA_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-llama"

__all__ = ["MODELS", "TINY_LLAMA_DIR", "gemma3_270m_path", "load_gemma3_270m", "load_gguf", "load_local",
           "load_model", "load_tiny", "model_name"]


def load_tiny(dtype: torch.dtype = torch.float32):
    """Load the shipped tiny Llama and its tokenizer. Returns ``(model, tokenizer)``, model in eval mode.

    The weights are stored in fp16; ``dtype`` is what they are cast to (fp32 by default, for CPU).
    Raises FileNotFoundError naming the folder if the asset has not been trained / installed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}")
    missing = [
        n
        for n in ("config.json", "model.safetensors", "tokenizer.json")
        if not (TINY_LLAMA_DIR / n).is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"tiny model asset missing in {TINY_LLAMA_DIR} (no {', '.join(missing)}); "
            "train it with `python benchmarks/train_tiny_lm.py`"
        )
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA_DIR, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA_DIR, local_files_only=True)
    return model.eval(), tokenizer


# Models known by name (the CLI's --model takes these as well as paths).
MODELS = {"gemma3-270m": load_gemma3_270m, "tiny": load_tiny}


def load_model(name: str, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` of a model in :data:`MODELS` (``"gemma3-270m"``, ``"tiny"``)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name](dtype)
