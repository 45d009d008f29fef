"""The serving benchmark's stream, padding and one contender run end to end on the smoke model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from h2o_compile.bench.serve import (Server, ServeSettings, decode_tokens_per_s, kv_ratios, left_pad,
                                     request_batches, run_contender, serve_report)


def test_the_stream_is_seeded_and_covers_every_request_once():
    settings = ServeSettings(requests=30, prompt_min=10, prompt_max=50, max_batch=5)
    batches = request_batches(settings, vocab=100)
    again = request_batches(settings, vocab=100)
    assert [len(b) for b in batches] == [len(b) for b in again]
    assert all(torch.equal(x, y) for b, c in zip(batches, again) for x, y in zip(b, c))
    assert sum(len(b) for b in batches) == 30
    assert all(1 <= len(b) <= 5 for b in batches) and len({len(b) for b in batches}) > 1
    lengths = [p.numel() for b in batches for p in b]
    assert min(lengths) >= 10 and max(lengths) <= 50 and len(set(lengths)) > 10
    assert all(int(p.min()) >= 8 and int(p.max()) < 100 for b in batches for p in b)
    other = request_batches(ServeSettings(requests=30, prompt_min=10, prompt_max=50, max_batch=5, seed=1), 100)
    assert [p.numel() for b in other for p in b] != lengths


def test_left_pad_puts_every_prompt_at_the_right_edge():
    ids, mask = left_pad([torch.tensor([5, 6, 7]), torch.tensor([9])], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.mark.parametrize("bad,match", [(dict(model="gpt5"), "model='gpt5'"),
                                       (dict(contenders=["vllm"]), "contenders=\\['vllm'\\]"),
                                       (dict(prompt_min=100, prompt_max=50), "prompt_min"),
                                       (dict(budget=1.5), "budget=1.5")])
def test_bad_settings_name_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        ServeSettings(**bad)


def test_any_local_model_is_served(model_dir):
    from h2o_compile.bench.serve import load_model

    settings = ServeSettings(model=str(model_dir))
    model = load_model(settings.model, "cpu")
    assert model.config.vocab_size == 96 and model.generation_config.eos_token_id is None
    for bad in (model_dir / "missing", model_dir / "config.json", ""):  # no folder with a config.json, no .gguf
        with pytest.raises(ValueError, match="or give a local model folder"):
            ServeSettings(model=str(bad))


@pytest.mark.parametrize("contender", ["h2o-eager", "hf-dynamic"])
def test_a_contender_serves_the_whole_stream(contender):
    settings = ServeSettings(model="smoke", requests=5, prompt_min=12, prompt_max=60, new_tokens=4, max_batch=3,
                             probe_lengths=[33], probe_batch=2, contenders=[contender])
    result = run_contender(contender, settings, progress=False)
    batches = request_batches(settings, vocab=256)
    assert [b["batch"] for b in result["batches"]] == [len(b) for b in batches]
    assert [b["padded_prompt"] for b in result["batches"]] == [max(p.numel() for p in b) for b in batches]
    assert all(0 < b["prefill_s"] < b["seconds"] for b in result["batches"])
    assert result["wall_s"] >= sum(b["seconds"] for b in result["batches"]) * 0.99
    assert result["p50_latency_s"] <= result["p95_latency_s"] <= result["wall_s"] * 1.01
    assert result["tokens_per_s"] == pytest.approx(5 * 4 / result["wall_s"])
    if contender == "hf-dynamic":
        assert kv_ratios(result) is None
    else:  # ceil(0.2 x (P + 4)) slots of every P + 4 tokens, plus the scores and positions
        worst, stream = kv_ratios(result)
        assert 0.2 <= stream <= worst <= 0.32
    assert decode_tokens_per_s(result, 4) == pytest.approx(
        5 * 3 / sum(b["seconds"] - b["prefill_s"] for b in result["batches"]))
    text = serve_report({"settings": vars(settings), "results": [result]}, "cmd", "machine")
    assert f"| {contender} |" in text


def test_the_report_checks_each_compiled_h2o_row_against_the_given_targets():
    settings = ServeSettings(model="smoke", contenders=["h2o-compiled", "h2o-max-autotune", "hf-dynamic",
                                                        "hf-static-compile"])

    def row(name, wall):  # one batch of 2 requests, prefill a tenth of it
        return dict(contender=name, wall_s=wall, tokens_per_s=1.0, prefill_s=wall / 10, p50_latency_s=wall,
                    p95_latency_s=wall, peak_rss_mib=1.0, compiled_graphs=1, probes=[dict(ratio=1.0)],
                    batches=[dict(batch=2, seconds=wall, prefill_s=wall / 10)])

    result = {"settings": vars(settings), "results": [row("h2o-compiled", 100.0), row("h2o-max-autotune", 40.0),
                                                      row("hf-dynamic", 120.0), row("hf-static-compile", 90.0)]}
    text = serve_report(result, "cmd", "machine", targets=(2.5, 1.5))
    assert "- h2o-compiled total wall time vs hf-dynamic: **1.20x** faster (target >= 2.5x): **missed**" in text
    assert "- h2o-compiled total wall time vs hf-static-compile: **0.90x** faster (target >= 1.5x): **missed**" in text
    assert "- h2o-max-autotune total wall time vs hf-dynamic: **3.00x** faster (target >= 2.5x): met" in text
    assert "- h2o-max-autotune total wall time vs hf-static-compile: **2.25x** faster (target >= 1.5x): met" in text


@pytest.mark.parametrize("name,compile,regional", [("h2o-max-autotune", "max-autotune", False),
                                                   ("h2o-compiled", True, False),
                                                   ("h2o-compiled-by-layer", True, True)])
def test_each_h2o_contender_compiles_as_its_name_says(monkeypatch, name, compile, regional):
    from h2o_compile.bench import serve

    seen = {}
    monkeypatch.setattr(serve, "optimize", lambda model, budget, **kw: seen.update(kw))
    Server(name, object(), ServeSettings(model="smoke", contenders=[name]))
    assert seen == {"compile": compile, "regional_compile": regional}


def test_a_warm_inductor_cache_serves_each_compiling_contender_twice_in_one_cache(monkeypatch):
    """inductor_cache="warm": a compiling contender's first process fills the cache its second one (the measured
    one) reads; a contender that compiles nothing runs once."""
    import h2o_compile.bench.serve as serve

    calls = []

    def fake_run(cmd, env, check):
        name, out = cmd[cmd.index("--worker") + 1], Path(cmd[cmd.index("--out") + 1])
        calls.append((name, env["TORCHINDUCTOR_CACHE_DIR"]))
        out.write_text(json.dumps({"contender": name, "wall_s": 10.0 * len(calls), "tokens_per_s": 1.0}))

    monkeypatch.setattr(serve.subprocess, "run", fake_run)
    settings = ServeSettings(model="smoke", contenders=["h2o-compiled", "hf-dynamic", "hf-static-compile"],
                             inductor_cache="warm")
    result = serve.run_serve(settings, log=lambda *_: None)
    assert [name for name, _ in calls] == ["h2o-compiled", "h2o-compiled", "hf-dynamic", "hf-static-compile",
                                           "hf-static-compile"]
    assert calls[0][1] == calls[1][1] != calls[3][1] == calls[4][1]  # one cache per contender, shared by its runs
    rows = {r["contender"]: r for r in result["results"]}
    assert (rows["h2o-compiled"]["cold_wall_s"], rows["h2o-compiled"]["wall_s"]) == (10.0, 20.0)
    assert "cold_wall_s" not in rows["hf-dynamic"]
    assert (rows["hf-static-compile"]["cold_wall_s"], rows["hf-static-compile"]["wall_s"]) == (40.0, 50.0)


def test_inductor_cache_setting_names_the_bad_value():
    with pytest.raises(ValueError, match="inductor_cache='hot'"):
        ServeSettings(inductor_cache="hot")
