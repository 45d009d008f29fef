"""How tests know a compiled step really ran compiled: dynamo's counters, with a recompile-limit hit raising
instead of silently falling back to eager."""

from __future__ import annotations

import contextlib

import torch
from torch._dynamo.utils import counters


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
