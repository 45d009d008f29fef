"""transformers' ``generate(custom_generate=h2o_compile.CUSTOM_GENERATE, trust_remote_code=True, ...)``: the same
tokens as ``optimize(model, ...).generate(...)`` for the same settings, greedy and sampled, the optimized model
built once per model and settings, and what an H2O cache does not serve refused by name."""

from __future__ import annotations

import pytest
import torch

import h2o_compile
from h2o_compile.integrations.custom_generate import _CACHE

from ..runtime.arch_configs import VOCAB, build

PROMPTS = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
MASK = torch.ones_like(PROMPTS).index_fill_(1, torch.tensor([0, 1]), 0)[[1, 0]]  # row 0 left-padded by 2


@pytest.fixture(scope="module")
def model():
    return build("llama")


def _through_transformers(model, **kwargs):
    return model.generate(input_ids=PROMPTS, attention_mask=MASK, custom_generate=h2o_compile.CUSTOM_GENERATE,
                          trust_remote_code=True, max_new_tokens=24, **kwargs)


@pytest.mark.parametrize("settings", [dict(budget=8, config="recommended"), dict(budget=0.3, policy="sink"),
                                      dict(config="tova+budget=10")])
def test_greedy_tokens_equal_optimize(model, settings):
    got = _through_transformers(model, do_sample=False, **settings)
    opt = h2o_compile.optimize(model, **settings)
    want = opt.generate(PROMPTS, attention_mask=MASK, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, want)
    assert opt.stream.capacity < PROMPTS.shape[1] + 24  # the cache evicted: the settings reached the model


def test_sampled_tokens_equal_optimize_with_the_same_seed(model):
    torch.manual_seed(7)
    got = _through_transformers(model, budget=8, do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(7)
    want = h2o_compile.optimize(model, budget=8).generate(PROMPTS, attention_mask=MASK, max_new_tokens=24,
                                                         do_sample=True, top_k=20, temperature=0.9)
    assert torch.equal(got, want)


def test_the_optimized_model_is_built_once_per_settings(model):
    model.__dict__.pop(_CACHE, None)
    _through_transformers(model, budget=8, do_sample=False)
    first = dict(model.__dict__[_CACHE])
    _through_transformers(model, budget=8, do_sample=False)
    assert model.__dict__[_CACHE] == first and len(first) == 1
    _through_transformers(model, budget=9, do_sample=False)
    assert len(model.__dict__[_CACHE]) == 2


def test_what_an_h2o_cache_does_not_serve_is_refused_by_name(model):
    with pytest.raises(ValueError, match="assistant_model"):
        _through_transformers(model, budget=8, assistant_model=model)
    with pytest.raises(ValueError, match="score='nope'"):
        _through_transformers(model, budget=8, score="nope")
    with pytest.raises(ValueError, match=r"budget = 1 - compression_ratio = 0.2"):
        _through_transformers(model, compression_ratio=0.8)
