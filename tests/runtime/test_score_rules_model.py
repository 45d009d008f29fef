"""Score rules through the whole model: H2OModel's logits against transformers itself with the brute-force
H2O simulation masking its attention (tests/runtime/hf_simulation.py), prompt first, then decode steps; and
one compiled decode step across prompt windows and prompt lengths."""

from __future__ import annotations

import pytest
import torch

import h2o_compile

from .arch_configs import VOCAB, build
from .compile_checks import assert_ran_compiled, strict_compile
from .hf_simulation import simulate_logits

# (H2OConfig score options, the same for the simulation)
RULES = [
    (dict(score="mean"), dict(score="mean")),
    (dict(decay=0.5), dict(decay=0.5)),
    (dict(decay=0.0), dict(decay=0.0)),
    (dict(prompt_window=4), dict(prompt_window=4)),
    (dict(prompt_window=5, prompt_pool=3), dict(prompt_window=5, pool=3)),
    # the prompt rules with a decayed score (the README's setting for retrieval and running text alike)
    (dict(decay=0.9, prompt_window=5, prompt_pool=3), dict(decay=0.9, prompt_window=5, pool=3)),
    # the decayed peak: each key's largest (decayed) attention from one query
    (dict(score="max"), dict(score="max")),
    (dict(score="max", decay=0.9, prompt_window=5, prompt_pool=3),
     dict(score="max", decay=0.9, prompt_window=5, pool=3)),
    # query-free: the keys with the smallest L2 norm stay
    (dict(score="knorm"), dict(score="knorm")),
]


@pytest.fixture(scope="module")
def llama():
    return build("llama", seed=5)


@pytest.mark.parametrize("options,sim_options", RULES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_rules_equal_the_simulation_inside_transformers(llama, options, sim_options):
    opt = h2o_compile.optimize(llama, budget=7, sink_tokens=1, compile=False, **options)
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    opt.reset(2, 20)
    ours = torch.cat([opt.step(ids[:, :14])] + [opt.step(ids[:, i:i + 1]) for i in range(14, 20)], dim=1)
    want = simulate_logits(llama, ids, [14] + [1] * 6, capacity=7, recent=4, sinks=1, policy="h2o", **sim_options)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


def test_a_prompt_window_covering_the_prompt_is_the_paper(llama):
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    kept = {}
    for window in (None, 16, 2):
        opt = h2o_compile.optimize(llama, budget=6, prompt_window=window, compile=False)
        opt.generate(ids, max_new_tokens=3)
        kept[window] = [opt.kept_positions(layer) for layer in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(kept[None], kept[16]))
    assert not all(torch.equal(a, b) for a, b in zip(kept[None], kept[2])), "a 2-query window changed nothing"


@pytest.mark.parametrize("score", ["sum", "max"])
def test_prompt_windows_are_a_run_time_input_of_one_compiled_step(llama, score):
    """Prompts of new lengths and left padding under a prompt window and a decay (of the sum and of the peak):
    one compiled decode step, equal to eager."""
    rule = dict(budget=0.3, prompt_window=3, decay=0.9, score=score)
    compiled = h2o_compile.optimize(llama, compile=True, **rule)
    eager = h2o_compile.optimize(llama, compile=False, **rule)
    gen = torch.Generator().manual_seed(5)
    with strict_compile():
        for batch, length in [(1, 20), (3, 33), (2, 47)]:
            ids = torch.randint(1, VOCAB, (batch, length), generator=gen)
            mask = torch.ones_like(ids)
            mask[1:, :5] = 0
            assert torch.equal(compiled.generate(ids, mask, max_new_tokens=4), eager.generate(ids, mask,
                                                                                               max_new_tokens=4))
        assert_ran_compiled(graphs=1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(score="peak"), "score='peak'"), (dict(score="mean", decay=0.5), "decay=0.5 must be 1"),
    (dict(prompt_pool=2), "prompt_pool=2"), (dict(prompt_window=0), "prompt_window=0"),
    (dict(prompt_pool=3, prefill=8), "needs prefill='full'"), (dict(policy="local", score="mean"), "policy='local'"),
    (dict(decay=-0.1), "decay=-0.1"),
    (dict(sliding_score="sum"), "compress_sliding=True puts under the policy"),
    (dict(sliding_score="peak", compress_sliding=True), "sliding_score='peak'; allowed: None"),
    (dict(score="max", sliding_score="mean", decay=0.5, compress_sliding=True),
     "sliding_score='mean': .*decay=0.5 must be 1"),
    (dict(policy="sink", sliding_score="max", compress_sliding=True), "policy='sink' reads no scores"),
    # the Llama has no sliding-window layer: the option would do nothing
    (dict(sliding_score="sum", compress_sliding=True), "this model has no sliding-window layer"),
])
def test_bad_score_options_are_named(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        h2o_compile.optimize(llama, compile=False, **kwargs)
