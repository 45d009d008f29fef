"""The continuous-batching benchmark's stream, accounting and contenders on the smoke model: every contender
serves every request, and requests get the same greedy tokens from continuous batching as from fixed groups."""

from __future__ import annotations

import pytest

from h2o_compile.bench.serve_continuous import (ContinuousSettings, _own_tokens, _quantile, continuous_report,
                                                make_stream, run_contender)


def test_the_stream_is_seeded_with_arrivals_in_order():
    settings = ContinuousSettings(requests=40, rate=4.0, prompt_min=10, prompt_max=50, new_min=3, new_max=9)
    stream = make_stream(settings, vocab=100)
    assert [(r.at, r.prompt, r.new_tokens) for r in stream] == [(r.at, r.prompt, r.new_tokens)
                                                                 for r in make_stream(settings, vocab=100)]
    arrivals = [r.at for r in stream]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and len(set(arrivals)) == 40
    mean_gap = arrivals[-1] / 39
    assert 0.15 < mean_gap < 0.4  # a Poisson stream at 4/s: gaps of 0.25 s on average
    assert {len(r.prompt) for r in stream} <= set(range(10, 51)) and len({len(r.prompt) for r in stream}) > 10
    assert {r.new_tokens for r in stream} <= set(range(3, 10)) and len({r.new_tokens for r in stream}) > 3
    assert min(min(r.prompt) for r in stream) >= 8 and max(max(r.prompt) for r in stream) < 100


def test_a_request_counts_its_own_tokens_up_to_its_limit_and_eos():
    assert _own_tokens([5, 6, 7, 8], limit=3, eos={2}) == [5, 6, 7]
    assert _own_tokens([5, 2, 7, 8], limit=3, eos={2}) == [5, 2]
    assert _own_tokens([5, 6, 7, 2], limit=3, eos={2}) == [5, 6, 7]
    assert _own_tokens([5, 6], limit=3, eos=set()) == [5, 6]


def test_quantiles_are_nearest_rank():
    values = list(range(1, 101))
    assert (_quantile(values, 0.5), _quantile(values, 0.99), _quantile(values, 1.0)) == (50, 99, 100)
    assert _quantile([7.0], 0.99) == 7.0


@pytest.mark.parametrize("bad,match", [(dict(model="gpt5"), "model='gpt5'"),
                                       (dict(contenders=["vllm"]), "contenders=\\['vllm'\\]"),
                                       (dict(new_min=10, new_max=5), "new_min"),
                                       (dict(rate=0), "rate=0"), (dict(rows=0), "rows=0")])
def test_bad_settings_name_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        ContinuousSettings(**bad)


@pytest.fixture(scope="module")
def served():
    settings = ContinuousSettings(model="smoke", requests=5, rate=20.0, prompt_min=8, prompt_max=40, new_min=2,
                                  new_max=7, rows=2, compile=False)
    return settings, {name: run_contender(name, settings) for name in settings.contenders}


def test_every_contender_serves_every_request_with_the_same_tokens_in_each_family(served):
    settings, results = served
    stream = make_stream(settings, vocab=256)
    for name, r in results.items():
        assert [q["id"] for q in r["requests"]] == [a.id for a in stream], name
        for q, a in zip(r["requests"], stream):
            assert 1 <= q["tokens"] <= a.new_tokens and len(q["generated"]) == q["tokens"]
            assert 0 <= q["ttft_s"] <= q["latency_s"] and q["finish_s"] == pytest.approx(a.at + q["latency_s"])
        assert r["tokens"] == sum(q["tokens"] for q in r["requests"])
        assert r["span_s"] == pytest.approx(max(q["finish_s"] for q in r["requests"]))
        assert r["p50_latency_s"] <= r["p99_latency_s"]
        # Linux reports VmHWM as max(recorded peak, current RSS), so a read can exceed a later one by a little.
        assert r["peak_rss_first_done_mib"] <= r["peak_rss_mib"] * 1.01
    for a, b in (("h2o-continuous", "h2o-groups"), ("hf-continuous", "hf-groups")):
        assert [q["generated"] for q in results[a]["requests"]] == [q["generated"] for q in results[b]["requests"]]


def test_the_report_checks_the_targets(served):
    settings, results = served
    import dataclasses

    page = continuous_report({"settings": dataclasses.asdict(settings), "results": list(results.values()),
                              "same_tokens": {}}, "cmd", "machine")
    assert "| h2o-continuous |" in page and "| hf-groups |" in page
    ratio = results["h2o-continuous"]["tokens_per_s"] / results["hf-continuous"]["tokens_per_s"]
    assert f"tokens/s vs hf-continuous: **{ratio:.2f}x** (target >= 1.5x)" in page
