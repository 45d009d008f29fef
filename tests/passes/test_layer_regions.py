"""The decode step split at its decoder layers (passes/layer_regions.py): the split graph, run region by region
with each distinct region's code shared by every region of its structure, computes bit for bit what the flat
graph computes, on every architecture the pass supports; layers of one kind share one region; a graph whose
layers interleave is refused; and H2OModel's ``regional_compile`` switch picks the path and checks its value."""

from __future__ import annotations

import pytest
import torch

import h2o_compile
from h2o_compile.runtime import model as runtime
from h2o_compile.graph.passes.layer_regions import (LayersInterleaved, region_module, regional_graph, split_regions,
                                              structure)
from h2o_compile.runtime import decode_step_graph

from ..runtime.arch_configs import ARCHITECTURES, HYBRID, VOCAB, build
from ..runtime.compile_checks import assert_ran_compiled, strict_compile

_CPU = torch.device("cpu")


def _first_decode_inputs(opt, flat, batch: int = 2, prompt: int = 11) -> tuple:
    """The inputs H2OModel gives its compiled step at a request's first decode step (the prompt fed before),
    the cache state as it was before that step."""
    gen = torch.Generator().manual_seed(batch * 100 + prompt)
    seen = []

    def record(*inputs):
        seen.append([x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
        return flat(*inputs)

    opt._compiled_step = record
    opt.reset(batch, prompt + 4)
    opt.step(torch.randint(1, VOCAB, (batch, prompt), generator=gen))
    opt.step(torch.randint(1, VOCAB, (batch, 1), generator=gen))
    (inputs,) = seen
    return inputs


@pytest.mark.parametrize("name", [*ARCHITECTURES, *HYBRID])
def test_the_split_step_computes_bit_for_bit_what_the_flat_step_computes(name):
    model = build(name, layers=3, seed=5)
    opt = h2o_compile.optimize(model, budget=6, compile=True, regional_compile=True)
    flat = decode_step_graph(opt.graph, "default", _CPU)
    compiled_once = []
    split, distinct = regional_graph(flat, lambda region: compiled_once.append(region) or region)
    assert distinct == len(compiled_once) < len(split_regions(flat)[1])

    inputs = _first_decode_inputs(opt, flat)
    flat_inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    before = [x.clone() for x in inputs if isinstance(x, torch.Tensor)]
    want = flat(*flat_inputs)
    got = split(*inputs)
    assert torch.equal(got, want)
    tensors = [(a, b) for a, b in zip(inputs, flat_inputs) if isinstance(a, torch.Tensor)]
    for a, b in tensors:  # the step writes the same cache
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for (a, _), b in zip(tensors, before)), "the step wrote no state"


def test_identical_layers_share_one_region_and_the_hybrid_kinds_one_each():
    llama = h2o_compile.optimize(build("llama", layers=4, seed=1), budget=6)
    _, regions = split_regions(decode_step_graph(llama.graph, "default", _CPU))
    assert len(regions) == 6  # before the layers, 4 layers, after them
    _, distinct = regional_graph(decode_step_graph(llama.graph, "default", _CPU), lambda region: region)
    assert distinct == 3

    gemma3 = h2o_compile.optimize(build("gemma3", seed=1), budget=6)  # sliding, full, sliding
    step = decode_step_graph(gemma3.graph, "default", _CPU)
    outer, regions = split_regions(step)
    keys = [structure(region_module(r)) for r in regions]
    assert len(keys) == 5 and keys[1] == keys[3] and keys[1] != keys[2]  # sliding layers alike, the full one not


def _interleaved_graph() -> torch.fx.GraphModule:
    """x -> layer 0 -> layer 1 -> layer 0 again: no region call can hold layer 0."""

    class Three(torch.nn.Module):
        def forward(self, x):
            return ((x + 1) * 2) - 3

    gm = torch.fx.symbolic_trace(Three())
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    for node, layer in zip(calls, (0, 1, 0)):
        node.meta["nn_module_stack"] = {"l": (f"model.layers.{layer}", object)}
    return gm


def test_interleaved_layers_are_refused_by_name():
    with pytest.raises(LayersInterleaved, match="reads .* of a later region"):
        split_regions(_interleaved_graph())


def test_regional_compile_picks_the_path_and_checks_its_value(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "compile_step", lambda gm, *a, **k: calls.append("whole") or gm)
    monkeypatch.setattr(runtime, "compile_step_by_layer",
                        lambda gm, *a, **k: calls.append("by-layer") or (gm, 1))
    model = build("llama", seed=2)
    for regional, mode, want in [(False, True, "whole"), (True, True, "by-layer"),
                                 (True, "max-autotune-no-cudagraphs", "by-layer")]:
        opt = h2o_compile.optimize(model, budget=5, compile=mode, regional_compile=regional)
        opt.reset(1, 8)
        opt.step(torch.tensor([[3, 4, 5]]))
        opt.step(torch.tensor([[6]]))  # the first decode step builds the compiled step
        assert calls[-1] == want, (regional, mode)

    opt = h2o_compile.optimize(model, budget=5, compile="max-autotune", regional_compile=True)
    opt.reset(1, 8)
    opt.step(torch.tensor([[3, 4, 5]]))
    with pytest.raises(ValueError, match="regional_compile=True with compile='max-autotune'"):
        opt.step(torch.tensor([[6]]))
    with pytest.raises(ValueError, match="regional_compile='yes'; allowed: True or False"):
        h2o_compile.optimize(model, budget=5, regional_compile="yes")


def test_by_layer_declines_off_cpu(monkeypatch):
    model = build("llama", seed=2)
    monkeypatch.setattr(runtime.H2OModel, "device", property(lambda self: torch.device("cuda")))
    assert not h2o_compile.optimize(model, budget=5, compile=True)._compiles_by_layer("reduce-overhead")
    opt = h2o_compile.optimize(model, budget=5, compile=True, regional_compile=True)
    with pytest.raises(ValueError, match="regional_compile=True on cuda: compiling by layer is built and measured"):
        opt._compiles_by_layer("reduce-overhead")


@pytest.mark.parametrize("name,graphs", [("llama", 3), ("gemma3", 4)])  # before, one per kind of layer, after
def test_the_step_compiled_by_layer_decodes_as_eager_and_compiles_each_kind_once(name, graphs):
    """Two batch sizes and two capacities through one compiled step per kind of layer (no recompile), tokens and
    kept positions as the eager step's."""
    model = build(name, layers=3, seed=4)
    eager = h2o_compile.optimize(model, budget=0.3, compile=False)
    compiled = h2o_compile.optimize(model, budget=0.3, compile=True, regional_compile=True)
    gen = torch.Generator().manual_seed(6)
    with strict_compile():
        for batch, prompt, new in ((2, 20, 12), (3, 41, 25)):
            ids = torch.randint(1, VOCAB, (batch, prompt), generator=gen)
            assert torch.equal(compiled.generate(ids, max_new_tokens=new), eager.generate(ids, max_new_tokens=new))
            for layer in range(3):
                assert torch.equal(compiled.kept_positions(layer), eager.kept_positions(layer))
        assert_ran_compiled(graphs=graphs)
