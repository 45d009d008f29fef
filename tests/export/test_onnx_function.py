"""The ONNX function ai.h2o_compile::H2OAttention, run alone in ONNX Runtime, against kernels/reference.py.

A one-node ONNX model feeds its state back step after step (prefill blocks with left padding, then decode),
so eviction, the slot-stable layout and score accumulation are all compared, for every policy and every
attention kind (sliding window, soft-capping, learned sink logits)."""

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
from h2o_compile.export.onnx import ONNX_SCORE_CODES
from ..helpers import served_rules

NAMES = ["q", "k", "v", "positions", "valid", "key_cache", "value_cache", "score_cache", "pos_cache",
         "sink_logits", "rope_cos", "rope_sin"]
TYPES = [TensorProto.FLOAT] * 3 + [TensorProto.INT64, TensorProto.BOOL] + [TensorProto.FLOAT] * 3 + [
    TensorProto.INT64] + [TensorProto.FLOAT] * 3
RANKS = [4, 4, 4, 2, 2, 4, 4, 3, 3, 1, 3, 3]
NO_ROPE = np.zeros((1, 1, 2), np.float32)  # the placeholder tables of a true-positions layer
OUTS = ["out", "new_key", "new_value", "new_score", "new_position"]
OUT_TYPES = [TensorProto.FLOAT] * 4 + [TensorProto.INT64]
OUT_RANKS = [4, 4, 4, 3, 3]


def one_node_model(*, scale, recent, sinks, policy, seed, window=0, softcap=0.0, sink_initializer=None,
                   rolling=0, max_distance=0):
    """The function as the only node; ``policy`` is an eviction rule spec (kernels/rules.py). ``sink_initializer``
    [Hq] makes the sink logits a constant of the model (as in an export) instead of an input."""
    rule = reference.parse_rule(policy)
    node = helper.make_node(FUNCTION_NAME, NAMES, OUTS, domain=DOMAIN, scale=scale, recent=recent,
                            sinks=sinks, policy=reference.POLICY_CODES[rule.policy], seed=seed, window=window,
                            softcap=softcap, rolling=rolling, score=ONNX_SCORE_CODES[rule.score], decay=rule.decay,
                            max_distance=max_distance)

    def infos(names, types, ranks):
        return [helper.make_tensor_value_info(n, ty, [f"{n}_{i}" for i in range(r)])
                for n, ty, r in zip(names, types, ranks)]

    inputs, initializers = infos(NAMES, TYPES, RANKS), []
    if sink_initializer is not None:
        inputs = [i for i in inputs if i.name != "sink_logits"]
        initializers = [onnx.numpy_helper.from_array(np.asarray(sink_initializer, np.float32), "sink_logits")]
    graph = helper.make_graph([node], "h2o", inputs, infos(OUTS, OUT_TYPES, OUT_RANKS), initializers)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[H2OAttention.to_function_proto()])
    onnx.checker.check_model(model, full_check=True)
    return model


def run_sequence(policy, *, blocks, cap=6, recent=2, sinks=0, seed=5, b=2, hq=4, hkv=2, d=8, pos_offset=0,
                 tied_scores=False, torch_seed=0, window=0, softcap=0.0, sink_logits=None, gap=0, session=None,
                 rope=None):
    """Feed ``blocks`` (token counts) through the reference and the ONNX function; compare every step.

    ``window``, ``softcap``, ``sink_logits`` [Hq]: the attention kind (None = no sinks, fed as all -inf).
    ``gap``: positions skipped after every block, so more than T keys can leave a window in one step.
    ``session``: run this one instead of the one-node model (inputs named as NAMES, sink logits optional).
    ``rope``: rotary tables (kernels/rolling.RopeTables) for rolling positions, None = true positions.
    Returns (entries evicted, of which out of the window)."""
    if session is None:
        model = one_node_model(scale=0.3, recent=recent, sinks=sinks, policy=policy, seed=seed, window=window,
                               softcap=softcap, rolling=int(rope is not None),
                               max_distance=0 if rope is None else rope.max_distance)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(torch_seed)
    state = reference.empty_state(b, hkv, cap, d)
    onnx_state = [x.numpy() for x in state]
    onnx_sinks = np.full(hq, -np.inf, np.float32) if sink_logits is None else sink_logits.numpy()
    seen = torch.full((b,), pos_offset, dtype=torch.long)
    evictions = left_window = 0
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
        seen += valid.sum(1) + gap
        before = (state.pos_cache >= 0).sum()
        if window:
            newest = torch.where(valid, positions, -1).amax(1).view(b, 1, 1)
            left_window += int(((state.pos_cache >= 0) & (state.pos_cache <= newest - window)).sum())
        out, state = reference.h2o_attention(q, k, v, positions, valid, state, scale=0.3, recent=recent,
                                             sinks=sinks, policy=policy, seed=seed, window=window,
                                             softcap=softcap, sink_logits=sink_logits, rope=rope)
        evictions += int(before + valid.sum() * hkv - (state.pos_cache >= 0).sum())
        feeds = [q, k, v, positions, valid]
        tables = [NO_ROPE, NO_ROPE] if rope is None else [rope.cos.numpy(), rope.sin.numpy()]
        feed = dict(zip(NAMES, [x.numpy() for x in feeds] + onnx_state + [onnx_sinks] + tables))
        got = session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})
        onnx_state = got[1:]
        np.testing.assert_array_equal(got[4], state.pos_cache.numpy(), err_msg=f"positions, step {step}")
        np.testing.assert_allclose(got[0], out.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"output, step {step}")
        np.testing.assert_array_equal(got[1], state.key_cache.numpy(), err_msg=f"keys, step {step}")
        np.testing.assert_array_equal(got[2], state.value_cache.numpy(), err_msg=f"values, step {step}")
        np.testing.assert_allclose(got[3], state.score_cache.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"scores, step {step}")
    return evictions, left_window


BLOCKS = [5, 3, 1, 1, 4, 1, 1, 1, 2, 1, 1, 1, 7, 1, 1]


@pytest.mark.parametrize("policy,sinks", [("h2o", 0), ("h2o", 1), ("local", 0), ("sink", 2), ("random", 1),
                                          ("full", 0)])
def test_function_equals_reference(policy, sinks):
    evictions, _ = run_sequence(policy, blocks=BLOCKS, sinks=sinks)
    assert evictions > 0  # the comparison covered eviction, not only appends


@pytest.mark.parametrize("rule", served_rules("ONNX function"))
@pytest.mark.parametrize("window", [0, 4])
def test_score_rules_equal_reference(rule, window):
    evictions, _ = run_sequence(rule, blocks=BLOCKS, sinks=1, window=window)
    assert evictions > 0


def sink_logits(kind, hq=4):
    """None, or [Hq] fp32 learned sink logits; "mixed" gives some heads -inf (no sink for those heads)."""
    if kind is None:
        return None
    logits = torch.randn(hq, generator=torch.Generator().manual_seed(11)) * 2
    if kind == "mixed":
        logits[::2] = float("-inf")
    return logits


@pytest.mark.parametrize("sinks_kind", [None, "random"])
@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("window", [0, 4])
def test_attention_kinds_equal_reference(window, softcap, sinks_kind):
    # GQA (4 query heads on 2 KV heads), left padding, prefill blocks and decode steps; with W = 4 < C = 6
    # keys leave the window, including the protected sink token at position 0.
    evictions, left_window = run_sequence("h2o", blocks=BLOCKS, sinks=1, window=window, softcap=softcap,
                                          sink_logits=sink_logits(sinks_kind))
    assert evictions > 0
    assert (left_window > 0) == (window > 0)


@pytest.mark.parametrize("policy", ["local", "random", "full"])
def test_window_with_other_policies(policy):
    assert run_sequence(policy, blocks=BLOCKS, window=4, softcap=2.5, sink_logits=sink_logits("random"))[1] > 0


def test_window_larger_than_cache_and_blocks_longer_than_window():
    # W > C (eviction before the window matters) and T > W (a block's own early tokens leave its window).
    _, left_window = run_sequence("h2o", blocks=[9, 1, 1, 12, 1, 1, 1], cap=5, recent=2, sinks=1, window=7,
                                  sink_logits=sink_logits("random"))
    assert left_window > 0


def test_many_keys_leave_the_window_at_once():
    # Positions that jump by 5 per block kill more old entries than 2T in one decode step: every slot changes.
    _, left_window = run_sequence("h2o", blocks=[6, 1, 1, 1, 2, 1, 1], cap=6, recent=1, window=6, gap=5)
    assert left_window > 6


def test_sinks_with_minus_infinity_heads_have_no_nan():
    # Some heads with a sink, some without (-inf): the sink branch of the function must give no NaN.
    run_sequence("h2o", blocks=BLOCKS, sinks=1, sink_logits=sink_logits("mixed"), softcap=2.5)


@pytest.mark.parametrize("softcap,sinks,gone", [(0.0, None, {"If", "Tanh"}), (2.5, "random", {"If"})])
def test_constant_attention_kind_folds_away(tmp_path, softcap, sinks, gone):
    # An exported model's softcap is an attribute and its sinks an initializer: after ONNX Runtime inlines
    # the function, both Ifs fold to the branch taken, so a kind that is off costs nothing.
    logits = sink_logits(sinks)
    logits = np.full(4, -np.inf, np.float32) if logits is None else logits.numpy()
    model = one_node_model(scale=0.3, recent=2, sinks=0, policy="h2o", seed=0, softcap=softcap,
                           sink_initializer=logits)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    ops = {n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    assert "Softmax" in ops or "Exp" in ops  # the function was inlined
    assert not ops & gone


class OneOp(torch.nn.Module):
    """torch.ops.h2o.attention with its layer constants and learned sink logits (a parameter), as the FX
    pass leaves it in an exported graph."""

    def __init__(self, window, softcap, sink_logits):
        super().__init__()
        self.window, self.softcap = window, softcap
        self.sink_logits = None if sink_logits is None else torch.nn.Parameter(sink_logits)

    def forward(self, q, k, v, positions, valid, key_cache, value_cache, score_cache, pos_cache):
        return torch.ops.h2o.attention(q, k, v, positions, valid, key_cache, value_cache, score_cache,
                                       pos_cache, 0.3, 2, 1, "h2o", 5, self.window, self.softcap,
                                       self.sink_logits)[:5]  # the two scale outputs are empty here


def test_exporter_translation_carries_the_attention_kind():
    # export/onnx.py's translation: window and softcap become attributes, the sink parameter the sinks input.
    from h2o_compile.export.onnx import _attach_h2o_function, _h2o_translation, _quiet_exporter

    logits = sink_logits("random")
    module = OneOp(4, 2.5, logits).eval()
    b, t = 2, 3
    example = (torch.randn(b, 4, t, 8), torch.randn(b, 2, t, 8), torch.randn(b, 2, t, 8),
               torch.arange(t).expand(b, -1).contiguous(), torch.ones(b, t, dtype=torch.bool),
               *reference.empty_state(b, 2, 6, 8))
    block = torch.export.Dim("block", min=1, max=64)
    dims = ({2: block},) * 3 + ({1: block},) * 2 + (None,) * 4
    with torch.no_grad(), _quiet_exporter():
        program = torch.onnx.export(
            module, example, dynamo=True, dynamic_shapes=dims, input_names=NAMES[:9], output_names=OUTS,
            opset_version=18, optimize=False, verbose=False,
            custom_translation_table={torch.ops.h2o.attention.default: _h2o_translation})
    _attach_h2o_function(program, 18)
    proto = onnx.load_from_string(program.model_proto.SerializeToString())
    onnx.checker.check_model(proto, full_check=True)
    (node,) = [n for n in proto.graph.node if n.domain == DOMAIN]
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["window"] == 4 and attributes["softcap"] == 2.5
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == NAMES[:9]  # the sinks are a constant of the model
    _, left_window = run_sequence("h2o", blocks=BLOCKS, sinks=1, window=4, softcap=2.5, sink_logits=logits,
                                  session=session)
    assert left_window > 0


def test_block_longer_than_cache():
    # T > C: the block alone overflows the cache (a whole prompt with prefill="full").
    assert run_sequence("h2o", blocks=[9, 1, 12, 1], cap=4, recent=1)[0] > 0


def test_ties_follow_the_reference_order():
    assert run_sequence("h2o", blocks=[6, 1, 1, 1, 1, 3, 1, 1], sinks=1, tied_scores=True)[0] > 0
    assert run_sequence("h2o", blocks=[1] * 12, sinks=1, recent=1, cap=4, tied_scores=True)[0] > 0


def test_random_policy_hash_at_large_positions():
    # int64 Mul / Mod of the Lehmer hash with products near 2^52, where an int32 or float path would differ.
    assert run_sequence("random", blocks=[4, 1, 1, 2, 1, 1, 1], pos_offset=1_000_000, seed=123456)[0] > 0


def test_no_eviction_while_it_fits():
    assert run_sequence("h2o", blocks=[2, 1, 1], cap=8)[0] == 0


def test_function_is_standard_ops_only():
    proto = H2OAttention.to_function_proto()
    assert proto.domain == DOMAIN and proto.name == FUNCTION_NAME
    assert {n.domain for n in proto.node} == {""}
    assert list(proto.attribute) == ["scale", "recent", "sinks", "policy", "seed", "window", "softcap", "rolling",
                                     "score", "decay"]
    # Added with format 4, with a default: a node written without it numbers rolling positions by rank.
    assert [(a.name, a.i) for a in proto.attribute_proto] == [("max_distance", 0)]
    assert list(proto.input) == NAMES


@pytest.mark.parametrize("max_distance", [0, 5], ids=["rank", "capped"])
@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("rotary", [8, 4], ids=["full-rotary", "partial-rotary"])
@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_rolling_positions_equal_reference(policy, rotary, window, max_distance):
    """q, k and the cache unrotated, rotated by rank (or capped distance: 5, below the 7-token block's 6, over
    30 positions) in the function; tables longer than needed (as the graph gives them) and, for partial
    rotary, narrower than the head."""
    from h2o_compile.kernels.rolling import RopeTables

    inv_freq = 1.0 / (30.0 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    angles = torch.arange(6 + max(BLOCKS) + 2, dtype=torch.float64)[:, None] * inv_freq[None, :]
    both = torch.cat([angles, angles], dim=-1)[None]
    rope = RopeTables(both.cos().float(), both.sin().float(), max_distance)
    evictions, _ = run_sequence(policy, blocks=BLOCKS, sinks=2 if policy == "sink" else 0, window=window, rope=rope)
    assert evictions > 0
