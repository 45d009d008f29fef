"""The fused CPU prefill (kernels/cpu_prefill.py) against the executable spec ``reference.attend``: outputs and
per-key mass for every attention kind it serves, with padding, GQA / MQA, a cache of other heads' positions,
query weights and dtypes; and the op takes it on every layer it supports."""

from __future__ import annotations

import pytest
import torch

from h2o_compile.ops import dispatch
from h2o_compile.kernels import cpu_prefill, native_cpu, reference

from ..helpers import has_compiler, sink_logits_for

# (B, Hq, Hkv, T, C, D): MHA, GQA, MQA, one query chunk and several (T x S above the chunk size)
SHAPES = [(2, 4, 4, 7, 5, 16), (3, 8, 2, 33, 17, 32), (2, 8, 1, 20, 0, 64), (1, 4, 2, 1200, 900, 16)]


def _inputs(shape, dtype, seed=0, pad=True):
    b, hq, hkv, t, cap, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=gen).to(dtype)
    keys = torch.randn(b, hkv, cap + t, d, generator=gen).to(dtype)
    values = torch.randn(b, hkv, cap + t, d, generator=gen).to(dtype)
    valid = torch.ones(b, t, dtype=torch.bool)
    if b > 1 and pad:
        valid[1, : t // 3] = False  # left padding
    positions = (cap + valid.long().cumsum(1) - 1).clamp(min=0)
    # The cache: per head a different set of older positions, some slots empty (-1).
    old = torch.stack([torch.randperm(cap + 5, generator=gen)[:cap] for _ in range(b * hkv)]).view(b, hkv, cap)
    old = torch.where(torch.rand(b, hkv, cap, generator=gen) < 0.2, -1, old)
    new = torch.where(valid, positions, -1)[:, None, :].expand(b, hkv, t)
    positions = positions + 5  # the block comes after every cached position
    new = torch.where(new >= 0, new + 5, new)
    return q, keys, values, torch.cat([old, new], dim=2), positions, valid


@pytest.fixture(params=["one pass", "two pass"])
def mass_path(request, monkeypatch):
    """Both ways through an unpadded block (or row) that needs the mass or has a window: the native one-pass op
    and, as where it cannot be built, torch's fused kernel then the second q.k pass."""
    if request.param == "two pass":
        monkeypatch.setitem(native_cpu._state, "loaded", False)
    elif not has_compiler():
        pytest.skip("no C++ compiler here: the one-pass op cannot be built (the two-pass rows still run)")
    else:
        assert native_cpu.available()  # with a compiler, a failed build is a failure
    return request.param


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_hq{}_hkv{}_t{}_c{}_d{}".format(*s))
@pytest.mark.parametrize("kind", ["plain", "no padding", "window", "sinks", "weights", "sinks no padding",
                                  "prompt window", "prompt window no padding", "window empty cache",
                                  "window empty cache no padding", "peak", "peak no padding", "window peak",
                                  "weights peak", "prompt window no padding peak",
                                  "window empty cache no padding peak"])
def test_fused_prefill_equals_the_spec(shape, kind, mass_path):
    """One pass: every unpadded block (or row) through the native op. Two passes: padding or a window take the
    masked kernel in query chunks, a block without either the causal kernel plus one masked call over the
    cache (an empty cache when C = 0), then the mass pass (a sum, or for ``score="max"`` a peak)."""
    q, keys, values, key_pos, positions, valid = _inputs(shape, torch.float32, pad="no padding" not in kind)
    if "empty cache" in kind:  # a prompt's first block: each query chunk attends over its window's span only
        key_pos[..., :shape[4]] = -1
    kw = dict(window=6 if kind.startswith("window") else 0,
              sink_logits=sink_logits_for(shape[1], "cpu") if "sinks" in kind else None, peak="peak" in kind)
    weight = None
    if kind.startswith("weights"):
        weight = torch.rand(positions.shape, generator=torch.Generator().manual_seed(1))
    if "prompt window" in kind:  # only the last 5 queries count: the mass pass starts at the first of them
        weight = torch.zeros(positions.shape)
        weight[:, -5:] = 1.0
    cap = shape[4]
    out, mass = cpu_prefill.attend_sdpa(q, keys, values, key_pos, positions, valid, 0.3, new_from=cap,
                                        query_weight=weight, **kw)
    want_out, want_mass = reference.attend(q, keys, values, key_pos, positions, valid, 0.3, new_from=cap,
                                           query_weight=weight, **kw)
    torch.testing.assert_close(out, want_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(mass, want_mass, rtol=1e-4, atol=1e-4)
    assert not cpu_prefill.attend_sdpa(q, keys, values, key_pos, positions, valid, 0.3, new_from=cap,
                                       need_mass=False, **kw)[1].any()


def test_bf16_is_within_its_rounding(mass_path):
    """bf16 in and out: the output no further from fp32 than the spec's bf16 result (2x), the mass in fp32."""
    shape = (2, 8, 2, 40, 24, 64)
    q, keys, values, key_pos, positions, valid = _inputs(shape, torch.float32, seed=3)
    want_out, want_mass = reference.attend(q, keys, values, key_pos, positions, valid, 0.125, new_from=24)
    low = [x.bfloat16() for x in (q, keys, values)]
    out, mass = cpu_prefill.attend_sdpa(*low, key_pos, positions, valid, 0.125, new_from=24)
    spec_out, _ = reference.attend(*low, key_pos, positions, valid, 0.125, new_from=24)
    assert out.dtype == torch.bfloat16
    err, spec_err = (out.float() - want_out).abs().max(), (spec_out.float() - want_out).abs().max()
    assert err <= 2 * spec_err + 1e-3, (err, spec_err)
    torch.testing.assert_close(mass, want_mass, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("softcap,taken", [(0.0, True), (30.0, False)])
def test_the_op_takes_the_fused_path_where_it_applies(monkeypatch, softcap, taken):
    calls = []
    real = cpu_prefill.attend_sdpa
    monkeypatch.setattr(cpu_prefill, "attend_sdpa", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, keys, values, key_pos, positions, valid = _inputs((1, 4, 2, 6, 0, 16), torch.float32)
    state = reference.empty_state(1, 2, 4, 16)
    dispatch.h2o_attention(q, keys, values, positions, valid, state, scale=0.3, recent=1, sinks=0, policy="h2o",
                           softcap=softcap)
    assert bool(calls) is taken


def _record_fused_calls(monkeypatch) -> list:
    """(queries, keys, is_causal) of every fused-kernel call until monkeypatch.undo()."""
    calls = []
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    aten = torch.ops.aten

    class Recording:
        def __getattr__(self, name):
            return getattr(aten, name)

        def _scaled_dot_product_flash_attention_for_cpu(self, q, k, v, dropout, is_causal, **kwargs):
            calls.append((q.shape[2], k.shape[2], is_causal))
            return real(q, k, v, dropout, is_causal, **kwargs)

    monkeypatch.setattr(cpu_prefill.torch.ops, "aten", Recording())
    return calls


def _record_one_pass_calls(monkeypatch) -> list:
    """(queries, keys) of every native one-pass call until monkeypatch.undo()."""
    calls = []
    real = native_cpu.causal_attend_with_mass

    def recording(qf, kf, *args, **kwargs):
        calls.append((qf.shape[2], kf.shape[1]))
        return real(qf, kf, *args, **kwargs)

    monkeypatch.setattr(native_cpu, "causal_attend_with_mass", recording)
    return calls


@pytest.mark.parametrize("mass_kind", ["sum", "peak", "none"])
def test_a_left_padded_batch_takes_the_causal_kernel_row_by_row(monkeypatch, mass_path, mass_kind):
    """Prompts of different lengths, left-padded into one block (a serving batch): each row's valid suffix
    as a causal block of its own (the one-pass op when a rule reads the mass, its sum or its peak, else torch's
    causal kernel), none through a mask over the whole prefix; the spec's outputs and mass."""
    shape = (3, 4, 2, 300, 0, 16)
    q, keys, values, key_pos, positions, valid = _inputs(shape, torch.float32, seed=6)
    need_mass, peak = mass_kind != "none", mass_kind == "peak"
    one_pass = need_mass and mass_path == "one pass"
    calls = _record_one_pass_calls(monkeypatch) if one_pass else _record_fused_calls(monkeypatch)
    out, mass = cpu_prefill.attend_sdpa(q, keys, values, key_pos, positions, valid, 0.3, new_from=0,
                                        need_mass=need_mass, peak=peak)
    monkeypatch.undo()
    want_out, want_mass = reference.attend(q, keys, values, key_pos, positions, valid, 0.3, new_from=0, peak=peak)
    torch.testing.assert_close(out, want_out, rtol=2e-5, atol=2e-5)
    if need_mass:
        torch.testing.assert_close(mass, want_mass, rtol=1e-4, atol=1e-4)
    want_calls = [(200, 200), (300, 300), (300, 300)] if one_pass else [(200, 200, True), (300, 300, True),
                                                                          (300, 300, True)]
    assert sorted(calls) == want_calls, calls


@pytest.mark.parametrize("need_mass", [True, False])
def test_a_window_layer_attends_over_its_span_not_the_prefix(monkeypatch, mass_path, need_mass):
    """A 1200-token prompt on a W = 64 layer, the spec's outputs and mass: without the one-pass op every fused
    call reads at most one query chunk plus W keys; with it, one call whether or not the rule reads the mass
    (none returned when it does not)."""
    shape = (1, 4, 2, 1200, 0, 16)
    q, keys, values, key_pos, positions, valid = _inputs(shape, torch.float32, seed=5)
    one_pass = mass_path == "one pass"
    calls = _record_one_pass_calls(monkeypatch) if one_pass else _record_fused_calls(monkeypatch)
    out, mass = cpu_prefill.attend_sdpa(q, keys, values, key_pos, positions, valid, 0.3, new_from=0, window=64,
                                        need_mass=need_mass)
    monkeypatch.undo()
    want_out, want_mass = reference.attend(q, keys, values, key_pos, positions, valid, 0.3, new_from=0, window=64)
    torch.testing.assert_close(out, want_out, rtol=2e-5, atol=2e-5)
    if need_mass:
        torch.testing.assert_close(mass, want_mass, rtol=1e-4, atol=1e-4)
    else:
        assert not mass.any()
    if one_pass:
        assert calls == [(1200, 1200)], calls
    else:
        assert len(calls) > 1 and all(keys <= queries + 64 for queries, keys, _ in calls), calls
