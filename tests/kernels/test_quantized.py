"""Quantized kept entries (kv_dtype="int8", kernels/quantized.py; docs/design.md section 2 "Quantized entries") in
every torch backend against the float64 simulation, which rounds a vector when it is stored and reads the block's
own tokens exactly: the reference op, the fused CPU decode, the Triton kernels under the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from h2o_compile import ops
from h2o_compile.kernels import quantized, reference
from h2o_compile.kernels import reference_decode
from h2o_compile.kernels.rules import EvictionRule

from .conftest import assert_close_out, assert_same_state, random_block
from .h2o_simulation import SimulatedCache, int8_roundtrip
from .test_rolling import tables
from .test_score_rules import _drive, _fused_decode, _reference

pytest.importorskip("triton")
from h2o_compile.kernels import triton_ops  # after conftest set TRITON_INTERPRET


def test_quantize_is_symmetric_absmax_per_vector():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=gen) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)
    x[1, 2] = 0.0  # a zero vector: scale 1, all zeros
    q, scale = quantized.quantize(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 5) and scale.dtype == torch.float32
    assert float(scale[1, 2]) == 1.0 and not q[1, 2].any()
    assert int(q.abs().amax()) == 127 and int(q.min()) >= -127
    for i, j in [(0, 0), (1, 4), (2, 3), (1, 2)]:
        want = int8_roundtrip(x[i, j].double())
        torch.testing.assert_close(quantized.dequantize(q[i, j], scale[i, j]).double(), want, rtol=1e-6, atol=0)


RULES = [(EvictionRule(), None), (EvictionRule(score="mean"), None), (EvictionRule(decay=0.9, pool=3), 2),
         (EvictionRule(score="max", decay=0.8), None)]


@pytest.mark.parametrize("rule,window", RULES, ids=[f"{r.spec}-w{w}" for r, w in RULES])
@pytest.mark.parametrize("backend", [_reference, _fused_decode], ids=["reference", "fused_decode"])
def test_torch_backends_match_the_quantizing_simulation(backend, rule, window):
    _drive(backend, rule, window, quantized=True)


def _triton(q, k, v, positions, valid, state, query_from, **kw):
    return triton_ops.h2o_attention_(q, k, v, positions, valid, state, query_from=query_from, split_size=16, **kw)


@pytest.mark.parametrize("rule,window", RULES[:2], ids=[f"{r.spec}-w{w}" for r, w in RULES[:2]])
def test_triton_matches_the_quantizing_simulation(triton_device, rule, window):
    if triton_device.type != "cpu":
        pytest.skip("the simulation runs on CPU tensors")
    _drive(_triton, rule, window, quantized=True)


def _kind_steps(kind, b=2, hq=4, hkv=2, d=16, seed=1):
    """(q, k, v, positions, valid) blocks: a 9-token prompt, decode steps, a 3-token block."""
    gen = torch.Generator().manual_seed(seed)
    start = 0
    for t in (9, 1, 1, 3, 1, 1):
        q, k, v = (torch.randn(b, h, t, d, generator=gen) for h in (hq, hkv, hkv))
        positions = torch.arange(start, start + t).expand(b, t).contiguous()
        yield q, k, v, positions, torch.ones(b, t, dtype=torch.bool)
        start += t


KINDS = {"window": dict(window=5), "softcap": dict(softcap=2.0), "sinks": dict(sinks=True),
         "rolling": dict(rolling=True)}


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("backend", ["reference", "fused_decode", "triton"])
def test_attention_kinds_with_quantized_entries(backend, name, triton_device):
    """A sliding window, soft-capping, learned sinks and rolling positions read the dequantized cache."""
    if backend == "triton" and triton_device.type != "cpu":
        pytest.skip("the simulation runs on CPU tensors")
    kind = KINDS[name]
    b, hq, hkv, d, cap, recent = 2, 4, 2, 16, 5, 2
    group, scale = hq // hkv, d ** -0.5
    sink_logits = torch.tensor([0.5, -1.0, 2.0, 0.0]) if kind.get("sinks") else None
    inv_freq = 1.0 / 100.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8) if kind.get("rolling") else None
    rope = tables(inv_freq, 64) if inv_freq is not None else None
    op_kind = dict(window=kind.get("window", 0), softcap=kind.get("softcap", 0.0), sink_logits=sink_logits, rope=rope)
    state = reference.empty_state(b, hkv, cap, d, quantized=True)
    sims = [[SimulatedCache(cap, recent, 0, "h2o", window=kind.get("window"), softcap=kind.get("softcap"),
                            sink_logits=None if sink_logits is None else sink_logits[h * group:(h + 1) * group],
                            inv_freq=inv_freq, quantized=True) for h in range(hkv)] for _ in range(b)]
    for q, k, v, positions, valid in _kind_steps(kind):
        args = (q, k, v, positions, valid, state)
        params = dict(scale=scale, recent=recent, sinks=0, policy="h2o", **op_kind)
        if backend == "triton":
            out = triton_ops.h2o_attention_(*args, split_size=16, **params)
        elif backend == "fused_decode" and q.shape[2] == 1:
            rope_args = dict(rope_cos=rope.cos, rope_sin=rope.sin) if rope is not None else {}
            out = ops.decode_fusable_(q, k, v, positions, valid, *state[:4], scale, recent, 0, "h2o", 0,
                                      op_kind["window"], op_kind["softcap"], sink_logits, **rope_args,
                                      key_scale=state.key_scale, value_scale=state.value_scale)
        else:
            out = reference_decode.h2o_attention_(*args, **params)
        for row in range(b):
            pos = positions[row].tolist()
            for h in range(hkv):
                heads = slice(h * group, (h + 1) * group)
                want = sims[row][h].block(pos, q[row, heads].double(), k[row, h].double(), v[row, h].double(),
                                          scale)
                torch.testing.assert_close(out[row, heads].double(), want, rtol=1e-4, atol=1e-5)
                kept = sorted(p for p in state.pos_cache[row, h].tolist() if p >= 0)
                assert kept == sorted(sims[row][h].kept)


def test_quantized_state_is_a_quarter_of_fp32():
    fp32 = reference.empty_state(8, 4, 512, 64)
    int8 = reference.empty_state(8, 4, 512, 64, quantized=True)
    size = lambda state: sum(t.numel() * t.element_size() for t in state.tensors())  # noqa: E731
    assert size(int8) / size(fp32) < 0.3


def test_mismatched_quantized_state_is_named():
    q = k = v = torch.zeros(1, 2, 1, 16)
    state = reference.empty_state(1, 2, 4, 16, quantized=True)
    with pytest.raises(ValueError, match="key_scale None"):
        torch.ops.h2o.attention_(q, k, v, torch.zeros(1, 1, dtype=torch.long), None, *state[:4], 0.25, 1, 0, "h2o", 0)
    with pytest.raises(ValueError, match="key_scale must be float32"):
        torch.ops.h2o.attention_(q, k, v, torch.zeros(1, 1, dtype=torch.long), None, *state[:4], 0.25, 1, 0, "h2o", 0,
                                 key_scale=state.key_scale[..., :2], value_scale=state.value_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_int8_steps_equal_the_reference_on_its_device(triton_device, dtype):
    """The check that also runs on a GPU: a prompt, then decode steps (the int8 decode kernel) and a chunk, Triton
    against the reference op on the same device and state. The int8 entries and their scales must be equal (the
    write is the shared torch code); outputs within the dtype's tolerance."""
    b, hq, hkv, d, cap = 2, 8, 2, 32, 24
    gen = torch.Generator().manual_seed(7)
    kw = dict(scale=d ** -0.5, recent=6, sinks=1, policy="h2o")
    want = reference.empty_state(b, hkv, cap, d, dtype=dtype, device=triton_device, quantized=True)
    q, k, v = random_block(gen, b, hq, hkv, cap + 5, d, dtype, triton_device)
    positions = torch.arange(cap + 5, device=triton_device).expand(b, -1).contiguous()
    reference_decode.h2o_attention_(q, k, v, positions, None, want, **kw)
    got, start = want.clone(), cap + 5
    for t in [1, 1, 1, 4, 1, 1]:
        q, k, v = random_block(gen, b, hq, hkv, t, d, dtype, triton_device)
        positions = torch.arange(start, start + t, device=triton_device).expand(b, -1).contiguous()
        out_want = reference_decode.h2o_attention_(q, k, v, positions, None, want, **kw)
        out_got = triton_ops.h2o_attention_(q, k, v, positions, None, got, split_size=16, **kw)
        assert_close_out(out_got, out_want)
        assert_same_state(got, want)
        start += t
