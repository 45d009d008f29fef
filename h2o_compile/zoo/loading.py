"""Loading a model by what a user types: a zoo name, a local ``.gguf`` file, a local folder or a Hub id.

Used by the CLI commands and the benchmark scripts alike (it lives beside the zoo, not in the CLI, so the
command modules import it without importing each other).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .gemma import gemma3_270m_path, load_gemma3_270m, load_gguf

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
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # "name" or "organisation/name", as the Hub spells repositories


def load_pretrained(name: str, dtype: str = "float32"):
    """(model, tokenizer) from what a user types as ``--model``: a zoo name (``gemma3-270m``, ``tiny``), a local
    ``.gguf`` file, a local folder with a config.json, or a Hub id (``Qwen/Qwen2.5-0.5B-Instruct``), which
    transformers resolves with the user's Hub cache, token and offline mode (``HF_HUB_OFFLINE=1``).

    Args:
        name: the zoo name, the .gguf file, the folder or the Hub id.
        dtype: "float32", "float16" or "bfloat16".
    Raises:
        FileNotFoundError for a .gguf path that is no file; ValueError for a path that holds no model, and for a
        Hub id transformers cannot load (its error named, with what was tried).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(_DTYPES)}")
    torch_dtype = getattr(torch, dtype)
    if name in MODELS:
        return load_model(name, torch_dtype)
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"--model {name!r}: no such .gguf file")
        return load_gguf(path, torch_dtype)
    kinds = f"a folder with a config.json, a Hub id, a .gguf file, or one of {', '.join(MODELS)}"
    local = (path / "config.json").is_file()
    if not local and (path.exists() or not _HUB_ID.fullmatch(name)):
        raise ValueError(f"--model {name!r} is not {kinds}")
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        if local:
            raise
        raise ValueError(f"--model {name!r}: no local folder of that name, and transformers could not load it as "
                         f"a Hub id ({type(error).__name__}: {error}); --model takes {kinds}") from error
    return model, tokenizer


def model_name(path) -> str:
    """The name a report shows for ``--model PATH``: the zoo name, the folder's name, or tiny-llama by default."""
    if not path or path == "tiny":
        return "tiny-llama"
    return path if path in MODELS else Path(path).name


def transformers_id(name: str) -> str:
    """What transformers' own loaders (``transformers serve``) take for a model this library names: the shipped
    models by their zoo name, a local .gguf file as ``folder:file.gguf``; a folder or a Hub id as it is. A
    ``@revision`` suffix (transformers' canonical form, ``tiny@main``) is dropped from a zoo name."""
    zoo_name = name.partition("@")[0]
    if zoo_name == "tiny":
        return str(TINY_LLAMA_DIR)
    if zoo_name == "gemma3-270m":
        path = gemma3_270m_path()
        return f"{path.parent}:{path.name}"
    if name.endswith(".gguf") and Path(name).is_file():
        return f"{Path(name).parent}:{Path(name).name}"
    return name

