"""passes.last_logits: a graph copy that projects only the block's last position through the output embeddings."""

from __future__ import annotations

import pytest
import torch

import h2o_compile
from h2o_compile.graph.passes import last_position_logits
from tests.runtime.arch_configs import VOCAB, build


def _inputs(batch: int, t: int):
    ids = torch.randint(1, VOCAB, (batch, t), generator=torch.Generator().manual_seed(t))
    positions = torch.arange(t).expand(batch, -1).contiguous()
    return ids, positions, torch.ones(batch, t, dtype=torch.bool)


@torch.no_grad()
def test_the_copy_returns_the_last_row_and_leaves_the_graph_alone():
    opt = h2o_compile.optimize(build("llama", seed=2), budget=1.0, compile=False)
    last = last_position_logits(opt.graph, "model.lm_head")
    results = []
    for graph in (opt.graph, last):
        opt.reset(2, 12)
        results.append(graph(*_inputs(2, 12), *opt.state(), *opt.stream.recent))
    full, ours = results
    assert full.shape == (2, 12, VOCAB) and ours.shape == (2, 1, VOCAB)
    torch.testing.assert_close(ours, full[:, -1:], rtol=1e-5, atol=1e-5)


def test_a_head_that_is_not_in_the_graph_is_named():
    opt = h2o_compile.optimize(build("llama", seed=2), budget=1.0, compile=False)
    with pytest.raises(ValueError, match="expected one aten.linear traced in 'model.no_head', found 0"):
        last_position_logits(opt.graph, "model.no_head")


@torch.no_grad()
def test_without_a_recognisable_head_step_slices_the_full_logits(monkeypatch):
    model = build("llama", seed=2)
    opt = h2o_compile.optimize(model, budget=1.0, compile=False)
    monkeypatch.setattr(model, "get_output_embeddings", lambda: None)
    ids = _inputs(2, 9)[0]
    opt.reset(2, 9)
    ours = opt.step(ids, logits_to_keep=1)
    opt.reset(2, 9)
    torch.testing.assert_close(ours, opt.step(ids)[:, -1:], rtol=1e-5, atol=1e-5)
