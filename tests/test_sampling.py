"""Sampling: the filtered distributions equal transformers' own logits processors on fixed logits, and seeded
samples follow them."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from h2o_compile.generation import next_tokens, sampling_probs


def transformers_probs(logits, temperature, top_k, top_p):
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k is not None:
        processors.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        processors.append(TopPLogitsWarper(top_p))
    return processors(None, logits.clone()).softmax(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, None, None), (0.6, None, None), (1.7, None, None), (1.0, 5, None), (0.8, 1, None),
    (1.0, None, 0.9), (1.3, None, 0.5), (0.7, 12, 0.8), (1.0, 40, 0.95),
])
def test_filtered_distribution_equals_transformers(temperature, top_k, top_p):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = sampling_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    theirs = transformers_probs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    if top_k is not None or top_p is not None:
        assert (ours == 0).any(), "the filters should remove some tokens on these logits"


def test_seeded_samples_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 1.5]]).expand(20_000, -1)
    probs = sampling_probs(logits[:1], temperature=0.9, top_k=4, top_p=None)[0]
    draws = next_tokens(logits, do_sample=True, temperature=0.9, top_k=4, top_p=None,
                        generator=torch.Generator().manual_seed(7))
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    assert freq[probs == 0].sum() == 0, "a token top-k removed was drawn"
    # 20k draws: the standard error of a frequency is <= 0.0036; allow 4 of them.
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.015)
