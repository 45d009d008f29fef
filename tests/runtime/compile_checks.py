"""How tests know a compiled step really ran compiled: dynamo's counters, with a recompile-limit hit raising
instead of silently falling back to eager."""

from __future__ import annotations

import contextlib

import torch
from torch._dynamo.utils import counters

import h2o_compile


@contextlib.contextmanager
def strict_compile():
    """Fresh dynamo state and counters; hitting the recompile limit is an error, not an eager fallback."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield counters


def assert_ran_compiled(graphs: int) -> None:
    """Exactly ``graphs`` graphs were compiled, with no graph break (and, under :func:`strict_compile`, no
    recompile-limit fallback to eager)."""
    assert dict(counters["graph_break"]) == {}, f"graph breaks: {dict(counters['graph_break'])}"
    assert counters["stats"]["unique_graphs"] == graphs, f"compiled {counters['stats']['unique_graphs']} graphs"
    assert (counters["stats"]["calls_captured"] > 0) == (graphs > 0), "no op was captured into a graph"


def assert_compiled_decode_equals_eager(model, settings: dict, ids: torch.Tensor, layers: int) -> None:
    """``optimize(model, **settings)`` compiled and eager on ``ids`` [B, T]: the same prompt logits (its first 10
    tokens), then one-token steps in one compiled graph without a break, the same logits, and the same kept
    positions on each of ``layers`` layers."""
    eager = h2o_compile.optimize(model, compile=False, **settings)
    compiled = h2o_compile.optimize(model, compile=True, **settings)
    for opt in (eager, compiled):
        opt.reset(ids.shape[0], ids.shape[1])
    torch.testing.assert_close(compiled.step(ids[:, :10]), eager.step(ids[:, :10]))
    with strict_compile():
        for i in range(10, ids.shape[1]):
            torch.testing.assert_close(compiled.step(ids[:, i:i + 1]), eager.step(ids[:, i:i + 1]), rtol=1e-4,
                                       atol=1e-4)
        assert_ran_compiled(graphs=1)
    for layer in range(layers):
        assert torch.equal(compiled.kept_positions(layer), eager.kept_positions(layer))
