"""The torch.ops.h2o boundary: compiles without graph breaks, equals eager, rejects bad shapes."""

from __future__ import annotations

import pytest
import torch

import h2o_compile  # noqa: F401
from h2o_compile.kernels import reference


def _blocks(seed, b=2, hq=8, hkv=2, d=16):
    gen = torch.Generator().manual_seed(seed)
    for start, t in [(0, 6), (6, 1), (7, 1), (8, 1), (9, 1)]:
        yield (torch.randn(b, hq, t, d, generator=gen), torch.randn(b, hkv, t, d, generator=gen),
               torch.randn(b, hkv, t, d, generator=gen), torch.arange(start, start + t).expand(b, t).contiguous())


def _step(q, k, v, positions, kc, vc, sc, pc):
    return torch.ops.h2o.attention_(q, k, v, positions, None, kc, vc, sc, pc, 0.25, 2, 1, "h2o", 0)


def test_compiled_equals_eager():
    torch._dynamo.reset()
    eager = reference.empty_state(2, 2, 4, 16)
    compiled = reference.empty_state(2, 2, 4, 16)
    step = torch.compile(_step, fullgraph=True)
    for q, k, v, positions in _blocks(0):
        want = _step(q, k, v, positions, *eager)
        got = step(q, k, v, positions, *compiled)
        torch.testing.assert_close(got, want)
        for x, y in zip(compiled, eager):
            torch.testing.assert_close(x, y)


def test_functional_op_exports():
    class Block(torch.nn.Module):
        def forward(self, q, k, v, positions, kc, vc, sc, pc):
            return torch.ops.h2o.attention(q, k, v, positions, None, kc, vc, sc, pc, 0.25, 2, 0, "h2o", 0)

    q, k, v, positions = next(_blocks(1))
    state = reference.empty_state(2, 2, 4, 16)
    ep = torch.export.export(Block(), (q, k, v, positions, *state[:4]))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.h2o.attention.default in targets
    inputs = (q, k, v, positions, *state[:4])
    torch.testing.assert_close(ep.module()(*inputs)[0], Block()(*inputs)[0])


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(k=a["k"][:, :, :, :8]), "k .* must be"),
    (lambda a: a.update(positions=a["positions"].int()), "positions must be int64"),
    (lambda a: a.update(kc=a["kc"][:, :1]), "key_cache has shape"),
    (lambda a: a.update(sc=a["sc"].half()), "score_cache must be float32"),
    (lambda a: a.update(q=a["q"][:, :3]), "multiple of KV heads"),
    (lambda a: a.update(valid=torch.ones(2, 5, dtype=torch.bool)), "valid must be bool"),
    (lambda a: a.update(policy="lru"), "policy='lru'"),
    (lambda a: a.update(recent=4, sinks=1), "recent \\+ sinks <= C=4"),
])
def test_bad_inputs_raise_value_error(mutate, match):
    q, k, v, positions = next(_blocks(2))
    kc, vc, sc, pc = reference.empty_state(2, 2, 4, 16)
    args = dict(q=q, k=k, v=v, positions=positions, valid=None, kc=kc, vc=vc, sc=sc, pc=pc, recent=2, sinks=0,
                policy="h2o")
    mutate(args)
    for op in (torch.ops.h2o.attention_, torch.ops.h2o.attention):
        with pytest.raises(ValueError, match=match):
            op(args["q"], args["k"], args["v"], args["positions"], args["valid"], args["kc"], args["vc"],
               args["sc"], args["pc"], 0.25, args["recent"], args["sinks"], args["policy"], 0)


def test_materialize_returns_equal_copies_that_share_no_memory():
    """h2o::materialize (ops/library.py) must not change a value, only where the compiled graph computes it."""
    a = torch.randn(2, 3, 5)[:, :, ::2]                        # non-contiguous, as the rotated query may be
    b = torch.arange(6.0).reshape(2, 3)
    copies = torch.ops.h2o.materialize([a, b])
    for original, copy in zip((a, b), copies):
        torch.testing.assert_close(copy, original, rtol=0, atol=0)
        assert copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
    torch.library.opcheck(torch.ops.h2o.materialize.default, ([a, b],))  # the fake kernel agrees (compile needs it)


def test_binding_a_call_compiles_on_a_fresh_schema():
    """The compiled CPU step traces OpSchema.bind; a schema whose derived fields were never used eagerly (a server
    compiles its decode step before any eager op call) must trace without a graph break, and bind the same."""
    from h2o_compile.ops.schema import H2O_ATTENTION, OpSchema

    fresh = OpSchema(H2O_ATTENTION.args, H2O_ATTENTION.state)
    args = tuple(torch.zeros(1) for _ in range(4)) + (None,) + tuple(torch.zeros(1) for _ in range(4)) + (0.5,)
    given = {"recent": 2, "sinks": 1, "policy": "h2o", "seed": 0}

    def use(x):
        bound = fresh.bind(args, given)
        return x + bound["scale"] + bound["recent"] + bound["sinks"] + bound["window"]

    compiled = torch.compile(use, fullgraph=True, backend="eager")
    assert float(compiled(torch.zeros(1))) == 0.5 + 2 + 1 + 0
    assert fresh.bind(args, given) == H2O_ATTENTION.bind(args, given)
    with pytest.raises(TypeError, match="missing a required argument: 'sinks'"):
        fresh.bind(args, {"recent": 2})
