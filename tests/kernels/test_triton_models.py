"""Whole hybrid models through the Triton backend (forced with H2O_COMPILE_BACKEND=triton; interpreted on CPU
in CI, compiled on a GPU) against the simulation inside transformers (tests/runtime/hf_simulation.py): each
layer's attention kind (window, Gemma 2's soft-capping, GPT-OSS's sinks) and each layer's own rule (a score per
kind of layer with a decay, a prompt window with pooling) reach the Triton prefill and decode kernels from the
layer's node, as they reach the reference op (tests/runtime/test_hybrid_architectures.py)."""

from __future__ import annotations

import pytest
import torch

import h2o_compile
from h2o_compile.kernels import reference, reference_decode
from tests.helpers import step_blocks
from tests.runtime.arch_configs import VOCAB, WINDOW, build
from tests.runtime.hf_simulation import simulate_logits

LENGTH = 4 * WINDOW  # several windows long
BUDGET, SINKS = 10, 1
FULL, SLIDING = dict(capacity=16, recent=8), dict(capacity=7, recent=4)  # global_share 1.6 over 1 full + 2 sliding


@pytest.fixture
def triton_backend(triton_device, monkeypatch):
    """The Triton backend forced, and the reference op's torch attention (prompt block and decode step) made
    to fail, so a model whose attention fell back to the reference path could not pass. The reference's
    scoring and eviction code still runs: the Triton backend shares it (kernels/triton_ops.py)."""
    monkeypatch.setenv("H2O_COMPILE_BACKEND", "triton")

    def not_the_reference(*args, **kwargs):
        raise AssertionError("the reference attention ran where the Triton backend was forced")

    monkeypatch.setattr(reference, "attend", not_the_reference)
    monkeypatch.setattr(reference_decode, "attend_decode", not_the_reference)
    return triton_device


@pytest.mark.parametrize("name,rule", [
    ("gemma3", dict(score="max", sliding_score="sum", decay=0.9)),
    ("gemma2", dict(score="sum", sliding_score="max", decay=0.9)),
    ("gpt_oss", dict(score="max", sliding_score="sum", decay=0.9, prompt_window=6, prompt_pool=3)),
])
def test_hybrid_model_through_triton_equals_simulation(triton_backend, name, rule):
    model = build(name, seed=1)
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    blocks = [20] + [1] * (LENGTH - 20)

    def layer_args(layer, window):  # docs/design.md section 2 per layer, written out independently of H2OConfig
        if window is None:
            return dict(FULL, sinks=SINKS, score=rule["score"])
        return dict(SLIDING, sinks=SINKS, score=rule["sliding_score"])

    want = simulate_logits(model, ids, blocks, capacity=None, recent=None, sinks=None, policy="h2o",
                           layer_args=layer_args, decay=rule["decay"], pool=rule.get("prompt_pool", 1),
                           prompt_window=rule.get("prompt_window"))
    opt = h2o_compile.optimize(model.to(triton_backend), budget=BUDGET, sink_tokens=SINKS, compile=False,
                               compress_sliding=True, global_share=1.6, **rule)
    got = step_blocks(opt, ids.to(triton_backend), blocks).float().cpu()
    assert opt.stream.slots == [SLIDING["capacity"], FULL["capacity"], SLIDING["capacity"]]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("allocation,slots", [((0.5, 1.6, 0.9), [[5, 5], [16, 16], [9, 9]]),
                                              (((0.5, 0.7), 1.4, (1.1, 0.9)), [[5, 7], [14, 14], [11, 9]])],
                         ids=["layers", "heads"])
def test_calibrated_split_through_triton_equals_simulation(triton_backend, allocation, slots):
    """A calibrated split at 10 slots: per layer 5, 16 and 9 slots, or per KV head (a layer's groups of heads,
    each its own op); recent windows round(c / 2), half to even."""
    model = build("gemma3", seed=1)
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    blocks = [20] + [1] * (LENGTH - 20)
    want = simulate_logits(model, ids, blocks, capacity=None, recent=None, sinks=None, policy="h2o",
                           layer_args=lambda layer, window, head: dict(capacity=slots[layer][head], sinks=SINKS,
                                                                       recent=round(slots[layer][head] / 2)))
    opt = h2o_compile.optimize(model.to(triton_backend), budget=BUDGET, sink_tokens=SINKS, compile=False,
                               compress_sliding=True, allocation=allocation)
    got = step_blocks(opt, ids.to(triton_backend), blocks).float().cpu()
    assert opt.stream.slots == [c for per in slots for c in (per if len(set(per)) > 1 else per[:1])]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
