"""H2O in EleutherAI's lm-evaluation-harness (the ``lm-eval`` extra): the model name ``h2o``.

    python -m h2o_compile.integrations.lm_eval_model --model h2o \\
        --model_args pretrained=Qwen/Qwen2.5-0.5B-Instruct,budget=0.2,config=recommended --tasks hellaswag

is lm-eval's own command line with ``h2o`` registered (lm-eval discovers no plugins, so ``lm_eval`` itself does
not know the name); from Python, import this module and call ``lm_eval.simple_evaluate(model="h2o",
model_args=...)``, or pass an :class:`~h2o_compile.H2OModel` as ``HFLM(pretrained=opt, tokenizer=...)``.
``model_args`` are HFLM's (``pretrained``, ``dtype``, ``batch_size``, ...) plus ``budget``, ``config`` (a preset
or a rule string), ``compile`` and any H2OConfig / ScoreRule field.

Every request type runs as ``H2OModel`` documents it: loglikelihood and rolling loglikelihood through
``forward`` (each position scored from the state H2O keeps at that point: one prompt token, then a decode step
per token), generate_until through ``generate`` (the prompt as one block, then decode steps).
"""

from __future__ import annotations

import sys

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..runtime import optimize
from .custom_generate import pop_h2o_settings


@register_model("h2o")
class H2OLM(HFLM):
    """lm-eval's HFLM over ``optimize(<the model HFLM loads>, budget, config=..., **H2O options)``."""

    def __init__(self, pretrained, **kwargs):
        config, compile_mode = pop_h2o_settings(kwargs)  # before the model loads: a bad setting fails first
        kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")  # HFLM's default is cuda
        super().__init__(pretrained=pretrained, **kwargs)
        self._model = optimize(self._model, config=config, compile=compile_mode)


def main() -> None:
    """lm-eval's command line (``lm_eval ...``) with the ``h2o`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
