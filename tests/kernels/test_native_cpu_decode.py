"""The native decode attention (kernels/native/decode_attend.cc) against a float64 softmax written out in full,
and where the decode step takes it: the eager reference path and the compiled CPU step on a float cache, never
an int8 one."""

from __future__ import annotations

import pytest
import torch

from h2o_compile.kernels import native_cpu, reference

from ..helpers import has_compiler

needs_compiler = pytest.mark.skipif(not has_compiler(), reason="no C++ compiler: the op cannot be built here")


@pytest.fixture(autouse=True)
def _built():
    if has_compiler():
        assert native_cpu.available()  # with a compiler, a failed build is a failure (the wrapper does not load)

# (B, Hq, Hkv, C, D): MHA, GQA, MQA, one slot, a 256-wide head (Gemma 3), a batch of one.
SHAPES = [(3, 4, 4, 40, 32), (2, 8, 2, 75, 16), (2, 4, 1, 33, 64), (2, 2, 2, 1, 8), (1, 4, 1, 20, 256)]


def _brute_force(q, k, v, valid, key_cache, value_cache, pos_cache, scale, new_pos, window, softcap, sink):
    """Each query head's logits over its KV head's C slots and the new key in float64, visibility from the
    positions, the sink as one more softmax column; the mass summed over the group's heads by a loop."""
    b, hq, _, _ = q.shape
    hkv, cap = key_cache.shape[1], key_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(b, hq, 1, value_cache.shape[3], dtype=torch.float64)
    mass = torch.zeros(b, hkv, cap + 1, dtype=torch.float64)
    for row in range(b):
        if not valid[row, 0]:
            continue
        for head in range(hq):
            n = head // group
            keys = torch.cat([key_cache[row, n], k[row, n]]).double()                # [C + 1, D]
            values = torch.cat([value_cache[row, n], v[row, n]]).double()
            logits = keys @ q[row, head, 0].double() * scale
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            seen = torch.cat([pos_cache[row, n] >= 0, torch.tensor([True])])
            if window:
                seen[:cap] &= pos_cache[row, n] > new_pos[row, n, 0] - window
            logits = logits.masked_fill(~seen, float("-inf"))
            extra = float("-inf") if sink is None else float(sink[head])
            probs = torch.softmax(torch.cat([logits, torch.tensor([extra], dtype=torch.float64)]), dim=0)[:-1]
            out[row, head, 0] = probs @ values
            mass[row, n] += probs
    return out, mass[..., :-1], mass[..., -1:]


def _inputs(shape, gen, dtype=torch.float32):
    b, hq, hkv, cap, d = shape
    q, k, v = (torch.randn(b, hq, 1, d, generator=gen), torch.randn(b, hkv, 1, d, generator=gen),
               torch.randn(b, hkv, 1, d, generator=gen))
    caches = tuple(torch.randn(b, hkv, cap, d, generator=gen).to(dtype) for _ in range(2))
    pos = torch.randint(0, 200, (b, hkv, cap), generator=gen)
    pos = torch.where(torch.rand(b, hkv, cap, generator=gen) < 0.2, -1, pos)  # a fifth of the slots empty
    valid = torch.ones(b, 1, dtype=torch.bool)
    valid[-1, 0] = b == 1  # the last row is padding (unless it is the only one)
    return q, k, v, valid, *caches, pos, torch.full((b, hkv, 1), 200)


@needs_compiler
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_hq{}_hkv{}_c{}_d{}".format(*s))
@pytest.mark.parametrize("window", [0, 60])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("sinks", [False, True])
def test_native_decode_equals_the_float64_softmax(shape, window, softcap, sinks):
    gen = torch.Generator().manual_seed(sum(shape) + window)
    inputs = _inputs(shape, gen)
    sink = torch.randn(shape[1], generator=gen) if sinks else None
    args = (*inputs[:7], shape[4] ** -0.5, inputs[7], window, softcap, sink)
    got = native_cpu.attend_decode(*args)
    want = _brute_force(*args)
    for name, g, w in zip(("out", "mass", "mass_new"), got, want):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6, msg=name)
    assert not got[1][inputs[6] < 0].any()  # an empty slot gets exactly nothing
    if shape[0] > 1:
        assert not got[0][-1].any() and not got[1][-1].any()  # padding: zero output, zero mass


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_cache_is_read_in_fp32(dtype):
    gen = torch.Generator().manual_seed(5)
    q, k, v, valid, kc, vc, pos, new_pos = _inputs((2, 4, 2, 50, 32), gen, dtype)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    out, mass, mass_new = native_cpu.attend_decode(q, k, v, valid, kc, vc, pos, 0.2, new_pos, 0, 0.0, None)
    want = _brute_force(q.float(), k.float(), v.float(), valid, kc.float(), vc.float(), pos, 0.2, new_pos, 0, 0.0,
                        None)
    assert out.dtype == dtype and mass.dtype == torch.float32
    torch.testing.assert_close(out.double(), want[0], rtol=1e-2, atol=1e-2)  # one rounding of the output
    torch.testing.assert_close(mass.double(), want[1], rtol=1e-5, atol=1e-6)  # the inputs as stored, fp32 inside


@needs_compiler
def test_bad_inputs_are_named():
    q, k, v, valid, kc, vc, pos, new_pos = _inputs((2, 4, 2, 10, 8), torch.Generator().manual_seed(0))
    op = torch.ops.h2o_cpu.attend_decode
    with pytest.raises(RuntimeError, match="must match q's batch and the caches' heads"):
        op(q, k, v, valid, kc[:1], vc, pos, 1.0, new_pos, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="one token per row"):
        op(q.expand(2, 4, 3, 8), k, v, valid, kc, vc, pos, 1.0, new_pos, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="a window needs new_pos"):
        op(q, k, v, valid, kc, vc, pos, 1.0, None, 4, 0.0, None)
    with pytest.raises(RuntimeError, match="float caches of one dtype"):
        op(q, k, v, valid, kc, vc.double(), pos, 1.0, new_pos, 0, 0.0, None)
    with pytest.raises(RuntimeError, match=r"sink must hold one logit per query head \(4\)"):
        op(q, k, v, valid, kc, vc, pos, 1.0, new_pos, 0, 0.0, torch.zeros(3))


def _decode(quantized: bool):
    """A 12-token prompt, then 17 one-token steps through the in-place op (8 slots: evictions every step).
    Returns the outputs and the final state."""
    gen = torch.Generator().manual_seed(7)
    state = reference.empty_state(2, 2, 8, 16, quantized=quantized)
    outs, start = [], 0
    for width in [12] + [1] * 17:
        q, k, v = (torch.randn(2, 4, width, 16, generator=gen), torch.randn(2, 2, width, 16, generator=gen),
                   torch.randn(2, 2, width, 16, generator=gen))
        positions = torch.arange(start, start + width).expand(2, width)
        outs.append(torch.ops.h2o.attention_(q, k, v, positions, None, *state.tensors()[:4], 0.25, 2, 1, "h2o", 0,
                                             key_scale=state.key_scale, value_scale=state.value_scale))
        start += width
    return outs, state


@needs_compiler
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_the_eager_decode_takes_the_native_op_on_a_float_cache_only(monkeypatch, kv_dtype):
    calls = []
    real = native_cpu.attend_decode
    monkeypatch.setattr(native_cpu, "attend_decode", lambda *a: calls.append(1) or real(*a))
    outs, state = _decode(kv_dtype == "int8")
    assert len(calls) == (0 if kv_dtype else 17)  # every one-token step, never the prompt
    with native_cpu.disabled():
        calls.clear()
        want, want_state = _decode(kv_dtype == "int8")
        assert not calls
    for got, expected in zip(outs, want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.pos_cache, want_state.pos_cache)  # the same evictions
    torch.testing.assert_close(state.score_cache, want_state.score_cache, rtol=1e-5, atol=1e-6)
