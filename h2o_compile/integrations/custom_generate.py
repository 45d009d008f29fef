"""H2O through transformers' own ``generate``: ``custom_generate`` runs this module's :func:`generate`.

    out = model.generate(**inputs, custom_generate=h2o_compile.CUSTOM_GENERATE, trust_remote_code=True,
                         budget=0.2, config="recommended", max_new_tokens=64)

transformers loads ``custom_generate/generate.py`` from the folder (or Hub repository) it is given and calls its
``generate(model=..., **generate's arguments)``; :data:`CUSTOM_GENERATE` is that folder inside this package, and
its ``generate.py`` calls :func:`generate` here. The H2O settings are generate keyword arguments: ``budget``,
``config`` (an H2OConfig, a preset or a rule string), ``compile`` and any H2OConfig / ScoreRule field; the rest
are transformers' own. The optimized model is built once per model and settings and kept on the model.
"""

from __future__ import annotations

from pathlib import Path

from ..config import OPTION_NAMES, H2OConfig
from ..config import resolve_config
from ..runtime import optimize

CUSTOM_GENERATE = str(Path(__file__).resolve().parent / "hub")
# compression_ratio: kvpress's name, taken so that H2OConfig refuses it with the budget it means.
H2O_KEYWORDS = frozenset({"budget", "config", "compile", "compression_ratio"}) | OPTION_NAMES
# generate's arguments that select what an H2O cache does not do: named when set.
_REFUSED = ("prefix_allowed_tokens_fn", "synced_gpus", "assistant_model", "negative_prompt_ids",
            "negative_prompt_attention_mask")
_CACHE = "_h2o_compile_models"  # on the transformers model: {settings: H2OModel}


def generate(model, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None,
             streamer=None, **kwargs):
    """``H2OModel.generate`` of ``model`` optimized with the H2O keyword arguments in ``kwargs`` (module
    docstring); the other arguments are transformers' generate's. Returns what ``H2OModel.generate`` returns."""
    refused = [name for name in _REFUSED if kwargs.pop(name, None) is not None]
    if refused:
        raise ValueError(f"{', '.join(refused)}: not served with an H2O cache (custom_generate=h2o_compile); "
                         "drop them or call generate without custom_generate")
    kwargs.pop("use_model_defaults", None)  # generate's defaults are the model's generation_config either way
    config, compile_mode = pop_h2o_settings(kwargs)
    key = (config.to_string(), compile_mode, str(model.device), model.dtype)
    if key not in model.__dict__.get(_CACHE, {}):
        opt = optimize(model, config=config, compile=compile_mode)
        # Looked up again: the capture inside optimize restores the model's attributes as they were before it.
        model.__dict__.setdefault(_CACHE, {})[key] = opt
    models = model.__dict__[_CACHE]
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("custom_generate=h2o_compile needs the prompt: input_ids (or inputs)")
    return models[key].generate(input_ids, kwargs.pop("attention_mask", None), generation_config, logits_processor,
                                stopping_criteria, streamer, **kwargs)


def pop_h2o_settings(kwargs: dict) -> tuple[H2OConfig, object]:
    """Take the H2O keyword arguments (:data:`H2O_KEYWORDS`) out of ``kwargs``: the H2OConfig they say (a bad one
    raises here, before any model loads) and the compile setting (False unless given: an evaluation or a script
    makes few calls)."""
    options = {name: kwargs.pop(name) for name in list(kwargs) if name in H2O_KEYWORDS}
    compile_mode = options.pop("compile", False)
    return resolve_config(options.pop("config", None), options.pop("budget", None), options), compile_mode
