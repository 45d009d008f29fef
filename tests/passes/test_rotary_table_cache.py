"""passes/rotary_table_cache.py: the rotary tables of rolling / capped positions computed once per table size.

It fired (a RotaryTables module, evaluations counted), its steps equal the graph without it bit for bit (also
across a block longer than the cap, which changes the size, and after an in-place write into the inverse
frequencies, which must not be served stale), and a graph without tables is left as it is."""

from __future__ import annotations

import pytest
import torch
from torch.fx import GraphModule

import h2o_compile
from h2o_compile.graph.passes.rotary_table_cache import RotaryTables, cache_rotary_tables

from ..runtime.arch_configs import VOCAB, build


def table_modules(gm: GraphModule) -> list[RotaryTables]:
    return [m for m in gm.modules() if isinstance(m, RotaryTables)]


def twins(name: str, **options):
    """Two H2OModels of one model: ``cached`` runs the pass (the default), ``plain`` the graph without it."""
    model = build(name)
    cached = h2o_compile.optimize(model, compile=False, **options)
    plain = h2o_compile.optimize(model, compile=False, **options)
    plain._eager_graph = plain.graph
    assert not table_modules(plain._eager_graph)
    return cached, plain


def steps(opt, ids: torch.Tensor, blocks: list[int]) -> list[torch.Tensor]:
    opt.reset(ids.shape[0], ids.shape[1])
    logits, start = [], 0
    for size in blocks:
        logits.append(opt.step(ids[:, start:start + size]))
        start += size
    return logits


@pytest.mark.parametrize("name, positions", [("gemma3", "capped"), ("llama", "capped"), ("gpt_neox", "rolling")])
def test_steps_equal_the_graph_without_the_cache(name, positions):
    """A prompt, single tokens, then a block longer than the cap (capped: S = T > D + 1, more rows than before;
    rolling: S = C + T), single tokens again."""
    options = dict(budget=12, positions=positions, **({"max_distance": 16} if positions == "capped" else {}))
    cached, plain = twins(name, **options)
    [tables] = table_modules(cached._eager_graph)
    ids = torch.randint(1, VOCAB, (2, 60), generator=torch.Generator().manual_seed(3))
    blocks = [8] + [1] * 20 + [24] + [1] * 7
    for k, (got, want) in enumerate(zip(steps(cached, ids, blocks), steps(plain, ids, blocks))):
        assert torch.equal(got, want), f"block {k} differs"
    assert tables.computed < len(blocks) // 4  # once per change of table size, not once per step


def test_computed_once_per_table_size():
    cached, _ = twins("gemma3", budget=12, positions="capped", max_distance=16)
    [tables] = table_modules(cached._eager_graph)
    ids = torch.randint(1, VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))
    steps(cached, ids, [8] + [1] * 12)       # S = D + 1 = 17 for all of them
    assert tables.computed == 1
    steps(cached, ids, [20] + [1] * 5)       # S = 20 for the prompt, 17 after it
    assert tables.computed == 3


def test_an_in_place_write_to_the_frequencies_recomputes():
    cached, plain = twins("llama", budget=12, positions="capped", max_distance=16)
    [tables] = table_modules(cached._eager_graph)
    ids = torch.randint(1, VOCAB, (1, 30), generator=torch.Generator().manual_seed(5))
    steps(cached, ids, [10, 1])
    frequencies = [b for name, b in cached.graph.named_buffers() if "inv_freq" in name]
    assert frequencies, "the captured graph should read the rotary inverse frequencies"
    with torch.no_grad():
        for buffer in frequencies:   # shared by both twins' graphs (one captured model)
            buffer.mul_(1.5)
    before = tables.computed
    got, want = steps(cached, ids, [10, 1, 1]), steps(plain, ids, [10, 1, 1])
    assert tables.computed == before + 1
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_true_positions_leave_the_graph_as_it_is():
    opt = h2o_compile.optimize(build("llama"), budget=12, compile=False)
    assert opt._eager_graph is opt.graph
    assert cache_rotary_tables(opt.graph) is opt.graph


def test_under_torch_compile_the_tables_are_computed_in_the_graph():
    class Ramp(torch.nn.Module):
        def forward(self, size, frequencies):
            return (torch.arange(size, dtype=torch.float32)[:, None] * frequencies).cos(),

    tables = RotaryTables(torch.fx.symbolic_trace(Ramp()))
    frequencies = torch.rand(4)
    compiled = torch.compile(tables, backend="eager", fullgraph=True)
    [got] = compiled(6, frequencies)
    assert torch.equal(got, (torch.arange(6.0)[:, None] * frequencies).cos())
    assert tables.computed == 0  # no cache lookup inside the compiled code
    tables(6, frequencies)
    tables(6, frequencies)
    assert tables.computed == 1
