"""H2OConfig validation and capacity arithmetic."""

import math

import pytest

from h2o_compile.runtime.cache_plan import layer_params, layer_shares
from h2o_compile import H2OConfig


@pytest.mark.parametrize("kwargs,match", [
    (dict(budget=0.0), "budget=0.0"),
    (dict(budget=1.5), "budget=1.5"),
    (dict(budget=-3), "budget=-3"),
    (dict(budget=0), "budget=0"),
    (dict(policy="lru"), "policy='lru'"),
    (dict(recent_ratio=1.2), "recent_ratio=1.2"),
    (dict(sink_tokens=-1), "sink_tokens=-1"),
    (dict(policy="local", sink_tokens=4), "policy='local' keeps no sinks"),
    (dict(prefill="chunked"), "prefill='chunked'"),
    (dict(prefill=0), "prefill=0"),
    (dict(seed=-1), "seed=-1"),
    (dict(budget=4, sink_tokens=3), "exceeds the cache capacity 4"),
])
def test_bad_values_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        H2OConfig(**kwargs)


@pytest.mark.parametrize("budget", ["0.2", None, True, [0.2]])
def test_budget_of_wrong_type_raises_type_error(budget):
    with pytest.raises(TypeError, match="budget must be"):
        H2OConfig(budget=budget)


@pytest.mark.parametrize("budget,total", [(0.2, 100), (0.2, 101), (0.05, 7), (1.0, 33), (0.5, 1)])
def test_float_budget_is_ceiling_of_fraction(budget, total):
    assert H2OConfig(budget=budget).capacity(total) == max(1, math.ceil(budget * total))


def test_int_budget_is_slots_capped_at_sequence():
    cfg = H2OConfig(budget=64)
    assert cfg.capacity(1000) == 64
    assert cfg.capacity(10) == 10


def test_policy_defaults():
    assert H2OConfig(policy="sink").sink_tokens == 4
    assert H2OConfig().sink_tokens == 0
    assert H2OConfig(policy="full", budget=0.1).capacity(500) == 500


@pytest.mark.parametrize("cap,ratio,expected", [(10, 0.5, 5), (7, 0.5, 4), (3, 0.0, 1), (9, 1.0, 9)])
def test_recent_window(cap, ratio, expected):
    assert H2OConfig(recent_ratio=ratio).recent_window(cap) == expected


def test_capacity_rejects_bad_total():
    with pytest.raises(ValueError, match="total_len=0"):
        H2OConfig().capacity(0)
    with pytest.raises(ValueError, match="exceeds the cache capacity"):
        H2OConfig(budget=0.1, sink_tokens=4).capacity(20)


@pytest.mark.parametrize("max_slots, before, block, reach", [(24, 100, 104, 128), (24, 10, 118, 128),
                                                             (24, 100, 105, 129), (200, 0, 129, 129)])
def test_rolling_positions_may_reach_the_models_last_position_and_no_further(max_slots, before, block, reach):
    """A block after ``before`` tokens rotates its keys up to min(C, before) + block - 1: position 127 of a
    model with 128 positions is the last one it knows."""
    from h2o_compile.graph.support import ModelLimits, check_rolling_fits

    limits = ModelLimits(num_layers=1, max_positions=128, windows=(0,), rotary=True)
    if reach <= 128:
        check_rolling_fits(limits, max_slots, before, block)
    else:
        with pytest.raises(ValueError, match=f"= {reach}, beyond the model's max_position_embeddings=128"):
            check_rolling_fits(limits, max_slots, before, block)
    check_rolling_fits(ModelLimits(num_layers=1, max_positions=None, windows=(0,)), max_slots, before, block)


GEMMA3_WINDOWS = ([512] * 5 + [0]) * 3  # Gemma 3 270M: 15 sliding-window layers, 3 full-attention ones


def test_global_share_splits_the_same_slots_by_kind():
    config = H2OConfig(budget=0.2, compress_sliding=True, global_share=2.0)
    shares = layer_shares(config, GEMMA3_WINDOWS)
    assert shares == [0.8] * 5 + [2.0] + [0.8] * 5 + [2.0] + [0.8] * 5 + [2.0]  # (18 - 3 x 2) / 15 = 0.8
    assert layer_shares(H2OConfig(), GEMMA3_WINDOWS) == [1.0] * 18
    # 1024 tokens at 0.2: C = 205; full-attention layers 410 slots, sliding ones 164 (at most their 512)
    assert layer_params(config, 1024, 0, share=2.0)[:2] == (410, 205)
    assert layer_params(config, 1024, 512, share=0.8)[:2] == (164, 82)
    assert layer_params(config, 1024, 100, share=0.8)[0] == 100  # never beyond the window
    assert layer_params(H2OConfig(budget=0.6, compress_sliding=True, global_share=2.0), 1000, 0, share=2.0)[0] == 1000
    assert layer_params(config, None, 0, capacity=100, share=2.0)[:2] == (200, 100)  # a stream of C = 100


@pytest.mark.parametrize("total_len, budget, share, full_slots, sliding_slots", [
    (1024, 0.2, 2.0, 410, 164),    # C = 205 <= W: (18 - 6) / 15 x C
    (1024, 0.2, 2.5, 512, 144),    # round(512.5) = 512 leave 3690 - 1536 = 2154 = 15 x 143.6
    (4106, 0.2, 2.0, 1644, 348),   # C = 822 > W: uniform 3 x 822 + 15 x 512 = 10146, 5214 left = 15 x 347.6
    (4106, 0.5, 2.0, 4106, 101),   # the full layers hold the sequence (capped), 13839 - 12318 = 15 x 101.4
    (None, 600, 2.0, 1200, 392),   # a stream of C = 600: uniform 3 x 600 + 15 x 512 = 9480, 5880 left
])
def test_global_share_keeps_the_uniform_splits_slots(total_len, budget, share, full_slots, sliding_slots):
    config = H2OConfig(budget=budget, compress_sliding=True, global_share=share)
    capacity = budget if total_len is None else config.capacity(total_len)
    shares = layer_shares(config, GEMMA3_WINDOWS, capacity, total_len)
    slots = [layer_params(config, total_len, w, capacity, share=s)[0] for w, s in zip(GEMMA3_WINDOWS, shares)]
    assert slots == ([sliding_slots] * 5 + [full_slots]) * 3
    uniform = 3 * capacity + 15 * min(capacity, 512)
    assert abs(sum(slots) - uniform) <= 15 / 2  # rounding: at most half a slot per sliding layer


def test_global_share_past_the_window_leaves_every_sliding_layer_its_sinks_and_a_recent_slot():
    config = H2OConfig(budget=0.2, compress_sliding=True, global_share=4.1)
    assert layer_shares(config, GEMMA3_WINDOWS, 822, 4106)[0] * 822 == pytest.approx(2.4)  # (10146 - 3 x 3370) / 15
    config = H2OConfig(budget=0.2, compress_sliding=True, global_share=4.12)
    with pytest.raises(ValueError, match=r"global_share=4.12 at C=822 slots \(4106 tokens\): the 3 full-attention "
                                         r"layers' 3387 slots each leave -15 of the uniform split's 10146 for 15 "
                                         r"sliding-window layers, -1 each, fewer than the 1 that sink_tokens \(0\) "
                                         r"and a recent window need; global_share <= 4.1083 leaves them 1"):
        layer_shares(config, GEMMA3_WINDOWS, 822, 4106)
    # with sinks a sliding layer needs more: 4 sinks + a recent window of round(0.5 x 8) = 4 (7: 4 + 4 > 7);
    # 4.09 x 822 -> 3362 slots leave (10146 - 10086) / 15 = 4 each; 3342 = (10146 - 15 x 8) / 3 leave 8
    config = H2OConfig(budget=0.2, compress_sliding=True, global_share=4.09, sink_tokens=4)
    with pytest.raises(ValueError, match=r"leave 60 of the uniform split's 10146 for 15 sliding-window layers, 4 "
                                         r"each, fewer than the 8 that sink_tokens \(4\) and a recent window need; "
                                         r"global_share <= 4.0657 leaves them 8"):
        layer_shares(config, GEMMA3_WINDOWS, 822, 4106)
    safe = H2OConfig(budget=0.2, compress_sliding=True, global_share=4.0657, sink_tokens=4)
    assert layer_shares(safe, GEMMA3_WINDOWS, 822, 4106)[0] * 822 == pytest.approx(8.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(global_share=2.0), "needs both compressed: set compress_sliding=True"),
    (dict(global_share=0.0, compress_sliding=True), r"global_share=0.0 must be a number >= 1"),
    (dict(global_share=True, compress_sliding=True), "global_share=True must be a number >= 1"),
    (dict(global_share=math.inf, compress_sliding=True), "must be a number >= 1"),
    (dict(global_share=0.5, compress_sliding=True), "which never hold more than their window; allowed: >= 1"),
    (dict(global_share=2.0, compress_sliding=True, policy="full"), "there are no slots to move"),
])
def test_bad_global_share(kwargs, match):
    with pytest.raises(ValueError, match=match):
        H2OConfig(**kwargs)


def test_global_share_needs_both_kinds_and_slots_left_for_the_sliding_layers():
    config = H2OConfig(compress_sliding=True, global_share=6.0)
    with pytest.raises(ValueError, match="3 full-attention layers of 18 would hold every slot; allowed: below 6"):
        layer_shares(config, GEMMA3_WINDOWS)
    with pytest.raises(ValueError, match="this model has 4 full-attention and 0 sliding-window layers"):
        layer_shares(H2OConfig(compress_sliding=True, global_share=2.0), [0] * 4)
