"""Loading a model by what a user types: a local folder, a local ``.gguf`` file, or a zoo name; never a hub.

Used by the CLI commands and the benchmark scripts alike (it lives beside the zoo, not in the CLI, so the
command modules import it without importing each other).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .gemma import load_gemma3_270m, load_gguf

TINY_LLAMA_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-llama"

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


_DTYPES = ("float32", "float16", "bfloat16")


def load_local(path: str, dtype: str = "float32"):
    """(model, tokenizer) from a local folder, a local ``.gguf`` file, or a zoo name (``gemma3-270m``,
    ``tiny``); never from a hub.

    Args:
        path: the folder (with a config.json), the .gguf file, or a name in :data:`h2o_compile.zoo.MODELS`.
        dtype: "float32", "float16" or "bfloat16".
    Raises:
        FileNotFoundError for a .gguf path that is no file; ValueError for anything else it cannot load.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(_DTYPES)}")
    torch_dtype = getattr(torch, dtype)
    if path in MODELS:
        return load_model(path, torch_dtype)
    folder = Path(path)
    if folder.suffix == ".gguf":
        if not folder.is_file():
            raise FileNotFoundError(f"--model {path!r}: no such .gguf file")
        return load_gguf(folder, torch_dtype)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {path!r} is not a folder with a config.json, a .gguf file, or one of "
                         f"{', '.join(MODELS)} (only local models load)")
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def model_name(path) -> str:
    """The name a report shows for ``--model PATH``: the zoo name, the folder's name, or tiny-llama by default."""
    if not path or path == "tiny":
        return "tiny-llama"
    return path if path in MODELS else Path(path).name
