"""The compiled CPU decode step: h2o.attention_ nodes retargeted to ops.decode_fusable_ (opaque attention +
plain-torch bookkeeping that Inductor fuses) must keep exactly the slots the reference op keeps."""

from __future__ import annotations

import pytest
import torch

import h2o_compile
from h2o_compile import ops
from h2o_compile.kernels import native_cpu, reference
from h2o_compile.graph.passes import count_h2o_ops, fuse_decode_bookkeeping, state_names
from h2o_compile.runtime import decode_step_graph

from .arch_configs import VOCAB, build
from ..helpers import has_compiler
from .compile_checks import assert_ran_compiled, strict_compile
from .hf_simulation import simulate_logits


@pytest.fixture(scope="module")
def llama():
    return build("llama", seed=11)


def test_fused_graph_retargets_every_layer_and_shares_the_weights(llama):
    opt = h2o_compile.optimize(llama, budget=5, compile=False)
    fused = fuse_decode_bookkeeping(opt.graph)
    targets = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    assert targets.count(ops.decode_fusable_) == len(opt.layers) == 2
    assert count_h2o_ops(fused) == 0 and count_h2o_ops(opt.graph) == 2  # the original graph is untouched
    assert {id(p) for p in fused.parameters()} == {id(p) for p in opt.graph.parameters()}
    with pytest.raises(ValueError, match="no in-place"):
        fuse_decode_bookkeeping(fused)


@pytest.mark.skipif(not has_compiler(), reason="no C++ compiler: the native op cannot be built here")
def test_the_cpu_step_attends_through_the_native_op_where_it_is_built(llama):
    opt = h2o_compile.optimize(llama, budget=5, compile=False)

    def native_flags():
        step = decode_step_graph(opt.graph, "default", torch.device("cpu"))
        return [n.kwargs.get("native", False) for n in step.graph.nodes if n.target is ops.decode_fusable_]

    assert native_flags() == [True, True]
    with native_cpu.disabled():
        assert native_flags() == [False, False]


def test_the_runtime_graph_takes_the_recent_windows_as_inputs(llama):
    opt = h2o_compile.optimize(llama, budget=5, compile=False)
    inputs = [n.name for n in opt.graph.graph.nodes if n.op == "placeholder"]
    assert inputs == ["input_ids", "position_ids", "valid", *state_names(0), *state_names(1), "recent0", "recent1",
                      "query_from"]
    ops = [n for n in opt.graph.graph.nodes if n.op == "call_function" and n.target is torch.ops.h2o.attention_.default]
    assert [n.args[10].name for n in ops] == ["recent0", "recent1"]
    # the prompt's scoring input (kernels/rules.py) reaches every op
    assert [n.kwargs["query_from"].name for n in ops] == ["query_from", "query_from"]


@pytest.mark.parametrize("batch,policy,sinks",
                         [(1, "h2o", 0), (3, "h2o", 1), (3, "random", 0), (2, "local", 0), (2, "sink", 2)])
def test_compiled_fused_decode_keeps_the_same_slots_as_the_op(llama, batch, policy, sinks):
    """Left-padded rows, a cache of 5 slots and 10 decode steps: eviction every step, padding rows included.
    The eager side without the native CPU ops (torch operators throughout), the compiled one with them."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, VOCAB, (batch, 16), generator=gen)
    mask = torch.ones(batch, 6, dtype=torch.long)
    mask[1:, :2] = 0  # rows after the first start two tokens later
    eager = h2o_compile.optimize(llama, budget=5, policy=policy, sink_tokens=sinks, compile=False)
    fused = h2o_compile.optimize(llama, budget=5, policy=policy, sink_tokens=sinks, compile=True)
    for opt in (eager, fused):
        opt.reset(batch, 16)
    with native_cpu.disabled():
        eager.step(ids[:, :6], mask)
        want = [eager.step(ids[:, i:i + 1]) for i in range(6, 16)]
    fused.step(ids[:, :6], mask)
    with strict_compile():
        for i in range(6, 16):
            torch.testing.assert_close(fused.step(ids[:, i:i + 1]), want[i - 6], rtol=1e-4, atol=1e-4)
        assert_ran_compiled(graphs=1)
    for layer in range(2):
        assert torch.equal(fused.kept_positions(layer), eager.kept_positions(layer))
        score = state_names(layer)[2]
        torch.testing.assert_close(getattr(fused.stream, score), getattr(eager.stream, score), rtol=1e-5, atol=1e-6)


def test_decode_fusable_equals_the_op_on_a_padding_step():
    """One row valid, one padding: the padding row's cache must stay as it was (eagerly, no compiler)."""
    torch.manual_seed(0)
    b, hq, hkv, cap, d = 2, 4, 2, 6, 8
    states = [reference.empty_state(b, hkv, cap, d) for _ in range(2)]
    for s in states:
        s.key_cache.copy_(torch.randn(b, hkv, cap, d, generator=torch.Generator().manual_seed(1)))
        s.pos_cache.copy_(torch.arange(cap).expand(b, hkv, cap))
        s.score_cache.copy_(torch.rand(b, hkv, cap, generator=torch.Generator().manual_seed(2)))
    q, k, v = torch.randn(b, hq, 1, d), torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d)
    pos, valid = torch.full((b, 1), cap, dtype=torch.long), torch.tensor([[True], [False]])
    args = (2, 0, "h2o", 0)
    out_op = torch.ops.h2o.attention_(q, k, v, pos, valid, *states[0], 0.5, *args)
    out_fused = ops.decode_fusable_(q, k, v, pos, valid, *states[1], 0.5, *args)
    torch.testing.assert_close(out_fused, out_op)
    for a, c in zip(*states):
        assert torch.equal(a, c)
    with pytest.raises(ValueError, match="T = 1"):
        ops.decode_fusable_(q.expand(b, hq, 2, d), k.expand(b, hkv, 2, d), v.expand(b, hkv, 2, d),
                            pos.expand(b, 2), None, *states[1], 0.5, *args)


def test_compiled_fused_decode_equals_the_simulation_and_leaves_padding_rows_alone(llama):
    """Against the independent brute force inside transformers (not the reference functions the fused step is
    built from): 12 evicting decode steps; then a step where row 1 is padding leaves its cache bytes as they
    were."""
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    blocks = [7] + [1] * 12
    fused = h2o_compile.optimize(llama, budget=5, sink_tokens=1, compile=True)
    fused.reset(2, 21)
    with strict_compile():
        ours = torch.cat([fused.step(ids[:, :7])] + [fused.step(ids[:, i:i + 1]) for i in range(7, 19)], dim=1)
        assert_ran_compiled(graphs=1)
    want = simulate_logits(llama, ids[:, :19], blocks, capacity=5, recent=fused.h2o_config.recent_window(5),
                           sinks=1, policy="h2o")
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)

    before = [t[1].clone() for t in fused.state()]
    fused.step(ids[:, 19:20], attention_mask=torch.tensor([[1], [0]]))
    for old, new in zip(before, fused.state()):
        assert torch.equal(old, new[1]), "a padding token changed its row's cache"
