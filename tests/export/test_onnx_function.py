"""The ONNX function ai.h2o_compile::H2OAttention, run alone in ONNX Runtime, against kernels/reference.py.

A one-node ONNX model feeds its state back step after step (prefill blocks with left padding, then decode),
so eviction, the slot-stable layout and score accumulation are all compared, for every policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from onnx import TensorProto, helper

from h2o_compile.export.onnx_function import DOMAIN, FUNCTION_NAME, H2OAttention
from h2o_compile.kernels import reference

NAMES = ["q", "k", "v", "positions", "valid", "key_cache", "value_cache", "score_cache", "pos_cache"]
TYPES = [TensorProto.FLOAT] * 3 + [TensorProto.INT64, TensorProto.BOOL] + [TensorProto.FLOAT] * 3 + [
    TensorProto.INT64]
RANKS = [4, 4, 4, 2, 2, 4, 4, 3, 3]
OUTS = ["out", "new_key", "new_value", "new_score", "new_position"]
OUT_TYPES = [TensorProto.FLOAT] * 4 + [TensorProto.INT64]
OUT_RANKS = [4, 4, 4, 3, 3]


def one_node_model(*, scale, recent, sinks, policy, seed):
    node = helper.make_node(FUNCTION_NAME, NAMES, OUTS, domain=DOMAIN, scale=scale, recent=recent,
                            sinks=sinks, policy=reference.POLICY_CODES[policy], seed=seed)

    def infos(names, types, ranks):
        return [helper.make_tensor_value_info(n, ty, [f"{n}_{i}" for i in range(r)])
                for n, ty, r in zip(names, types, ranks)]

    graph = helper.make_graph([node], "h2o", infos(NAMES, TYPES, RANKS), infos(OUTS, OUT_TYPES, OUT_RANKS))
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[H2OAttention.to_function_proto()])
    onnx.checker.check_model(model, full_check=True)
    return model


def run_sequence(policy, *, blocks, cap=6, recent=2, sinks=0, seed=5, b=2, hq=4, hkv=2, d=8, pos_offset=0,
                 tied_scores=False, torch_seed=0):
    """Feed ``blocks`` (token counts) through the reference and the ONNX function; compare every step."""
    model = one_node_model(scale=0.3, recent=recent, sinks=sinks, policy=policy, seed=seed)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(torch_seed)
    state = reference.empty_state(b, hkv, cap, d)
    onnx_state = [x.numpy() for x in state]
    seen = torch.full((b,), pos_offset, dtype=torch.long)
    evictions = 0
    for step, t in enumerate(blocks):
        q = torch.randn(b, hq, t, d, generator=gen)
        k, v = torch.randn(b, hkv, t, d, generator=gen), torch.randn(b, hkv, t, d, generator=gen)
        valid = torch.rand(b, t, generator=gen) > 0.25
        valid[:, -1] = True  # left padding only ends a row's block with a real token
        if step == 0:
            valid[1, : t // 2] = False
        positions = (seen[:, None] + valid.long().cumsum(1) - 1).clamp(min=pos_offset)
        if tied_scores:
            # Every query aligns with the key of position 0 (a sink) and against all others, whose
            # probabilities underflow to exactly 0: their scores tie at 0 and only positions decide.
            q = torch.ones_like(q)
            k = torch.where((positions == 0)[:, None, :, None], 100.0, -100.0).expand_as(k).contiguous()
        seen += valid.sum(1)
        before = (state.pos_cache >= 0).sum()
        out, state = reference.h2o_attention(q, k, v, positions, valid, state, scale=0.3, recent=recent,
                                             sinks=sinks, policy=policy, seed=seed)
        evictions += int(before + valid.sum() * hkv - (state.pos_cache >= 0).sum())
        feeds = [q, k, v, positions, valid]
        got = session.run(None, dict(zip(NAMES, [x.numpy() for x in feeds] + onnx_state)))
        onnx_state = got[1:]
        np.testing.assert_array_equal(got[4], state.pos_cache.numpy(), err_msg=f"positions, step {step}")
        np.testing.assert_allclose(got[0], out.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"output, step {step}")
        np.testing.assert_array_equal(got[1], state.key_cache.numpy(), err_msg=f"keys, step {step}")
        np.testing.assert_array_equal(got[2], state.value_cache.numpy(), err_msg=f"values, step {step}")
        np.testing.assert_allclose(got[3], state.score_cache.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"scores, step {step}")
    return evictions


BLOCKS = [5, 3, 1, 1, 4, 1, 1, 1, 2, 1, 1, 1, 7, 1, 1]


@pytest.mark.parametrize("policy,sinks", [("h2o", 0), ("h2o", 1), ("local", 0), ("sink", 2), ("random", 1),
                                          ("full", 0)])
def test_function_equals_reference(policy, sinks):
    evictions = run_sequence(policy, blocks=BLOCKS, sinks=sinks)
    assert evictions > 0  # the comparison covered eviction, not only appends


def test_block_longer_than_cache():
    # T > C: the block alone overflows the cache (a whole prompt with prefill="full").
    assert run_sequence("h2o", blocks=[9, 1, 12, 1], cap=4, recent=1) > 0


def test_ties_follow_the_reference_order():
    assert run_sequence("h2o", blocks=[6, 1, 1, 1, 1, 3, 1, 1], sinks=1, tied_scores=True) > 0
    assert run_sequence("h2o", blocks=[1] * 12, sinks=1, recent=1, cap=4, tied_scores=True) > 0


def test_random_policy_hash_at_large_positions():
    # int64 Mul / Mod of the Lehmer hash with products near 2^52, where an int32 or float path would differ.
    assert run_sequence("random", blocks=[4, 1, 1, 2, 1, 1, 1], pos_offset=1_000_000, seed=123456) > 0


def test_no_eviction_while_it_fits():
    assert run_sequence("h2o", blocks=[2, 1, 1], cap=8) == 0


def test_function_is_standard_ops_only():
    proto = H2OAttention.to_function_proto()
    assert proto.domain == DOMAIN and proto.name == FUNCTION_NAME
    assert {n.domain for n in proto.node} == {""}
    assert list(proto.attribute) == ["scale", "recent", "sinks", "policy", "seed"]
