"""Score rules (kernels/rules.py; docs/design.md section 2 "Score rules") in every torch backend against the float64
simulation, which applies them query by query: the reference op, the Triton kernels under the interpreter
(their bookkeeping is the shared torch code) and the fused CPU decode of ops.decode_fusable_.

A left-padded prompt longer than the cache (with ``query_from``: prompt window and pooling), then decode steps
(one with a padding token) and a mid-stream block.
"""

from __future__ import annotations

import pytest
import torch

from h2o_compile import H2OConfig, ScoreRule, ops
from h2o_compile.ops import dispatch
from h2o_compile.config import CAPABILITIES, check_served
from h2o_compile.kernels import reference
from h2o_compile.kernels import reference_decode
from h2o_compile.kernels.rules import EvictionRule, parse_rule

from .h2o_simulation import SimulatedCache

pytest.importorskip("triton")
from h2o_compile.kernels import triton_ops  # after conftest set TRITON_INTERPRET

# (rule, prompt window): the paper's rule, each option alone, and SnapKV's pair (window + pool).
RULES = [
    (EvictionRule(), None),
    (EvictionRule(score="mean"), None),
    (EvictionRule(decay=0.5), None),
    (EvictionRule(decay=0.0), None),
    (EvictionRule(), 3),
    (EvictionRule(pool=3), None),
    (EvictionRule(pool=5), 4),
    (EvictionRule(decay=0.9, pool=3), 2),
    (EvictionRule(score="max"), None),
    (EvictionRule(score="max", decay=0.8), None),
    (EvictionRule(score="max", decay=0.9, pool=3), 2),
    (EvictionRule(score="knorm"), None),
]
RULE_IDS = [f"{r.spec}-w{w}" for r, w in RULES]
PROMPT = 11            # tokens of row 0; row 1 has 3 padding tokens first
SCHEDULE = [1, 1, 3, 1, 1]  # after the prompt: decode steps, a block, decode steps
CAP, RECENT, SINKS = 6, 2, 1


def _rows(b, t, start, pad=0):
    positions = torch.arange(start, start + t).expand(b, t).clone()
    valid = torch.ones(b, t, dtype=torch.bool)
    if pad:
        valid[1, :pad] = False
        positions[1] = (torch.arange(t) - pad).clamp(min=0) + start
    return positions, valid


def _drive(step, rule: EvictionRule, window, b=2, hq=4, hkv=2, d=16, seed=0, quantized=False):
    """Feed the schedule through ``step(q, k, v, positions, valid, state, query_from)`` and the simulation,
    comparing outputs, kept positions and scores after each block (and, quantized, the stored vectors).
    Returns the last state."""
    gen = torch.Generator().manual_seed(seed)
    group, scale = hq // hkv, d ** -0.5
    state = reference.empty_state(b, hkv, CAP, d, quantized=quantized)
    sims = [[SimulatedCache(CAP, RECENT, SINKS, rule.policy, score=rule.score, decay=rule.decay, pool=rule.pool,
                            quantized=quantized) for _ in range(hkv)] for _ in range(b)]
    seen = [0] * b
    for i, t in enumerate([PROMPT] + SCHEDULE):
        # fp32 values in float64: the simulation quantizes exactly what the kernels are given.
        q, k, v = (torch.randn(b, h, t, d, generator=gen).double() for h in (hq, hkv, hkv))
        pad = 3 if i == 0 else 0
        positions, valid = _rows(b, t, seen[0], pad)
        if i == 3:
            valid[1] = False  # a padding token mid-stream: no attention, no decay, no write
        query_from = None
        if i == 0 and (window is not None or rule.pool > 1):
            lengths = valid.sum(1)
            query_from = lengths - window if window is not None else torch.zeros_like(lengths)
        out = step(q.float(), k.float(), v.float(), positions, valid, state, query_from,
                   scale=scale, recent=RECENT, sinks=SINKS, policy=rule.spec, seed=0)
        for row in range(b):
            cols = [j for j in range(t) if valid[row, j]]
            pos = [int(positions[row, j]) for j in cols]
            counted = None if query_from is None else {p for p in pos if p >= int(query_from[row])}
            for h in range(hkv):
                heads = slice(h * group, (h + 1) * group)
                want = sims[row][h].block(pos, q[row, heads][:, cols], k[row, h, cols], v[row, h, cols], scale,
                                          counted=counted, prompt=query_from is not None)
                if cols:
                    torch.testing.assert_close(out[row, heads][:, cols].double(), want, rtol=1e-4, atol=1e-5)
                kept = {p: s for p, s in zip(state.pos_cache[row, h].tolist(), state.score_cache[row, h].tolist())
                        if p >= 0}
                assert sorted(kept) == sorted(sims[row][h].kept), (i, row, h)
                for p, s in kept.items():
                    assert s == pytest.approx(sims[row][h].score[p], rel=1e-4, abs=1e-5), (i, row, h, p)
                if quantized:
                    _check_stored(state, row, h, sims[row][h])
            seen[row] += len(cols)
        seen = [max(seen)] * b  # rows advance together (left padding only shifts the prompt)
    return state


def _check_stored(state, row, h, sim):
    """Each kept slot holds the simulation's stored (quantized) key and value, scale times int8."""
    for slot, p in enumerate(state.pos_cache[row, h].tolist()):
        if p >= 0:
            key, value = sim.stored[p]
            torch.testing.assert_close(state.key_cache[row, h, slot].double() * float(state.key_scale[row, h, slot]),
                                       key, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(state.value_cache[row, h, slot].double()
                                       * float(state.value_scale[row, h, slot]), value, rtol=1e-6, atol=1e-6)


def _reference(q, k, v, positions, valid, state, query_from, **kw):
    return reference_decode.h2o_attention_(q, k, v, positions, valid, state, query_from=query_from, **kw)


def _triton(q, k, v, positions, valid, state, query_from, **kw):
    return triton_ops.h2o_attention_(q, k, v, positions, valid, state, query_from=query_from, **kw)


def _native_cpu(q, k, v, positions, valid, state, query_from, **kw):
    """The op's own path on CPU (h2o_compile/ops/dispatch.py): torch's fused attention and the native ops."""
    return dispatch.h2o_attention_(q, k, v, positions, valid, state, query_from=query_from, **kw)


def _fused_decode(q, k, v, positions, valid, state, query_from, **kw):
    """Decode tokens through the fused CPU path (ops.decode_fusable_), blocks through the op."""
    fn = ops.decode_fusable_ if q.shape[2] == 1 else torch.ops.h2o.attention_
    return fn(q, k, v, positions, valid, *state[:4], kw["scale"], kw["recent"], kw["sinks"], kw["policy"], kw["seed"],
              query_from=query_from, key_scale=state.key_scale, value_scale=state.value_scale)


@pytest.mark.parametrize("rule,window", RULES, ids=RULE_IDS)
@pytest.mark.parametrize("backend", ["reference", "compiled CPU step", "native CPU ops"])
def test_torch_backends_match_the_simulation(backend, rule, window):
    """Generated from the capability table: a backend serves the rule and equals the simulation, or refuses it."""
    drive = {"reference": _reference, "compiled CPU step": _fused_decode, "native CPU ops": _native_cpu}[backend]
    if CAPABILITIES[backend].serves_score(rule.score):
        _drive(drive, rule, window)
    else:
        with pytest.raises(ValueError, match=f"score='{rule.score}' is not served by the {backend}"):
            check_served(H2OConfig(rule=ScoreRule(score=rule.score)), backend)


@pytest.mark.parametrize("rule,window", RULES, ids=RULE_IDS)
def test_triton_matches_the_simulation(triton_device, rule, window):
    if triton_device.type != "cpu":
        pytest.skip("the simulation runs on CPU tensors; on a GPU test_triton_decode compares with the reference")
    assert CAPABILITIES["Triton"].serves_score(rule.score)  # else this test would check the refusal
    _drive(_triton, rule, window)


@pytest.mark.parametrize("score", ["sum", "max"])
@pytest.mark.parametrize("decay", [1.0, 0.7, 0.0])
def test_a_block_scores_as_its_tokens_one_by_one(decay, score):
    """With a decay, one block of T queries gives the scores of T single-token steps (the cache is large enough
    that nothing is evicted, so both keep every key)."""
    gen = torch.Generator().manual_seed(4)
    b, hq, hkv, t, d = 2, 4, 2, 9, 8
    q, k, v = (torch.randn(b, h, t, d, generator=gen) for h in (hq, hkv, hkv))
    positions = torch.arange(t).expand(b, t).contiguous()
    kw = dict(scale=d ** -0.5, recent=1, sinks=0, policy=EvictionRule(score=score, decay=decay).spec)
    whole, single = (reference.empty_state(b, hkv, t, d) for _ in range(2))
    reference_decode.h2o_attention_(q, k, v, positions, None, whole, **kw)
    for i in range(t):
        reference_decode.h2o_attention_(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1],
                                        positions[:, i:i + 1], None, single, **kw)
    torch.testing.assert_close(whole.score_cache, single.score_cache, rtol=1e-5, atol=1e-6)


def test_a_prompt_window_is_the_same_in_chunks():
    """A prompt window counts the same queries whether the prompt comes as one block or in chunks."""
    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, t, d = 1, 2, 1, 12, 8
    q, k, v = (torch.randn(b, h, t, d, generator=gen) for h in (hq, hkv, hkv))
    positions = torch.arange(t)[None]
    kw = dict(scale=d ** -0.5, recent=1, sinks=0, policy="h2o", query_from=torch.tensor([t - 4]))
    whole, chunked = (reference.empty_state(b, hkv, t, d) for _ in range(2))
    reference_decode.h2o_attention_(q, k, v, positions, None, whole, **kw)
    for s in (slice(0, 5), slice(5, 9), slice(9, 10), slice(10, 12)):
        reference_decode.h2o_attention_(q[:, :, s], k[:, :, s], v[:, :, s], positions[:, s], None, chunked, **kw)
    torch.testing.assert_close(whole.score_cache, chunked.score_cache, rtol=1e-5, atol=1e-6)
    # the first 8 queries added nothing: a key seen only by them scores 0 only if nobody later saw it, so check
    # the window instead: the summed score is the mass of 4 queries (each sums to 1 over the keys it sees)
    assert float(whole.score_cache.sum()) == pytest.approx(4 * hq, rel=1e-5)


@pytest.mark.parametrize("spec,message", [
    ("h2o+score=peak", "score='peak'"), ("h2o+decay=1.5", "decay=1.5"), ("h2o+prompt_pool=4", "prompt_pool=4"),
    ("h2o+score=mean+decay=0.5", "decay=0.5 must be 1"), ("sink+score=mean", "policy='sink'"),
    ("h2o+window=3", "cannot read 'window=3'"), ("lru", "policy='lru'"),
])
def test_bad_rules_are_named(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_rule(spec)


def test_the_paper_rule_is_the_bare_policy_name():
    assert EvictionRule().spec == "h2o" and parse_rule("h2o") == EvictionRule()
    for rule in (EvictionRule(decay=0.25, pool=5), EvictionRule(score="max", decay=0.9)):
        assert parse_rule(rule.spec) == rule
