"""Loading a model by what a user types: a local folder, a local ``.gguf`` file, or a zoo name; never a hub.

Used by the CLI commands and the benchmark scripts alike (it lives beside the zoo, not in the CLI, so the
command modules import it without importing each other).
"""

from __future__ import annotations

from pathlib import Path

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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import MODELS, load_gguf, load_model

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
    from . import MODELS

    if not path or path == "tiny":
        return "tiny-llama"
    return path if path in MODELS else Path(path).name
