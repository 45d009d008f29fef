"""The streaming evaluation: its perplexity against transformers' own logits, its windows, its report and CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from h2o_compile.cli import main
from h2o_compile.quality.stream import StreamRun, age_bin_edges, stream_perplexity
from h2o_compile.quality.stream_report import age_summary
from h2o_compile.zoo.loading import load_pretrained
from tests.runtime.arch_configs import VOCAB, build


def test_without_eviction_the_stream_perplexity_is_transformers_own():
    """120 tokens through 128 slots in chunks of 16: nothing is evicted, so the teacher-forced perplexity must
    be that of transformers' logits over the whole sequence (an independent computation)."""
    model = build("llama")
    ids = torch.randint(1, VOCAB, (120,), generator=torch.Generator().manual_seed(0))
    run = stream_perplexity(model, ids, capacity=128, chunk=16, policy="h2o", positions="rolling",
                            window_tokens=50, progress=False)
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1]
    want = math.exp(torch.nn.functional.cross_entropy(logits.double(), ids[1:]).item())
    assert run.perplexity == pytest.approx(want, rel=1e-5)
    assert [(w.start, w.end) for w in run.windows] == [(1, 51), (51, 101), (101, 120)]
    nll = sum(math.log(w.perplexity) * (w.end - w.start) for w in run.windows)
    assert math.exp(nll / 119) == pytest.approx(run.perplexity, rel=1e-9)
    assert all(w.tokens_per_s > 0 and w.rss_mib > 0 for w in run.windows)


def test_an_evicting_stream_past_the_positions_reports_every_window():
    """600 tokens (the model knows 128) through 24 slots: windows cover positions 1..599, the summary compares
    the last window with the first one that starts after the cache filled."""
    model = build("llama")
    ids = torch.randint(1, VOCAB, (600,), generator=torch.Generator().manual_seed(1))
    run = stream_perplexity(model, ids, capacity=24, chunk=8, policy="sink", positions="rolling",
                            window_tokens=100, progress=False)
    assert run.windows[0].start == 1 and run.windows[-1].end == 600
    assert sum(w.end - w.start for w in run.windows) == 599
    summary = run.summary()
    assert summary["first_full_window_ppl"] == run.windows[1].perplexity  # window 0 starts before 24 tokens
    assert summary["last_vs_first_full"] == pytest.approx(run.windows[-1].perplexity / run.windows[1].perplexity)
    assert run.sink_tokens == 4 and run.kv_bytes > 0


def test_the_age_histogram_of_an_oldest_first_stream_holds_exactly_the_newest_keys():
    """policy local keeps the newest C positions: at the end every full-attention layer and KV head holds ages
    0..C-1 once each, so the histogram is known without reading the cache."""
    model = build("llama")
    capacity, layers, kv_heads = 20, model.config.num_hidden_layers, model.config.num_key_value_heads
    ids = torch.randint(1, VOCAB, (300,), generator=torch.Generator().manual_seed(2))
    run = stream_perplexity(model, ids, capacity=capacity, chunk=8, policy="local", positions="rolling",
                            window_tokens=100, progress=False)
    assert run.age_edges[:6] == [0, 1, 2, 4, 8, 16] and run.age_edges[-1] >= 300
    want = [0] * (len(run.age_edges) - 1)
    for age in range(capacity):
        want[next(i for i in range(len(want)) if run.age_edges[i] <= age < run.age_edges[i + 1])] += layers * kv_heads
    assert run.age_counts == want


def test_a_stream_takes_score_rules_and_refuses_prompt_rules():
    """decay=1 is the paper's sum spelled differently (the same stream, the same perplexity); tova keeps other
    keys (another perplexity); a prompt window has no prompt in a chunked stream."""
    model = build("llama")
    ids = torch.randint(1, VOCAB, (200,), generator=torch.Generator().manual_seed(3))
    runs = {rule: stream_perplexity(model, ids, capacity=24, chunk=8, policy="h2o", positions="rolling",
                                    window_tokens=100, rule=rule, recent_ratio=0.25, progress=False)
            for rule in ("sum", "decay=1", "tova")}
    assert runs["decay=1"].perplexity == pytest.approx(runs["sum"].perplexity, rel=1e-6)
    assert runs["tova"].perplexity != pytest.approx(runs["sum"].perplexity, rel=1e-4)
    assert runs["tova"].label == "h2o [tova] recent 0.25 (rolling positions)"
    with pytest.raises(ValueError, match="has no prompt for a prompt window"):
        stream_perplexity(model, ids, capacity=24, chunk=8, rule="window=64+pool=9", progress=False)
    with pytest.raises(ValueError, match="not as recent= in the rule"):
        stream_perplexity(model, ids, capacity=24, chunk=8, rule="decay=0.9+recent=0.1", progress=False)
    with pytest.raises(ValueError, match="without compress_sliding .* sliding-window layers keep their window"):
        stream_perplexity(model, ids, capacity=24, chunk=8, rule="global=2", progress=False)


def test_a_stream_moves_slots_to_the_full_attention_layers_at_the_same_state():
    """gemma3 (2 sliding layers of W = 16, 1 full-attention one), C = 24 > W: the uniform split holds
    24 + 2 x 16 = 56 slots; global=1.5 puts 36 on the full layer and 10 on each sliding one: the same state
    bytes (the layers' slot sizes are equal), another perplexity."""
    model = build("gemma3", seed=4)
    ids = torch.randint(1, VOCAB, (160,), generator=torch.Generator().manual_seed(5))
    runs = {rule: stream_perplexity(model, ids, capacity=24, chunk=8, positions="rolling", rule=rule,
                                    window_tokens=80, progress=False, compress_sliding=True)
            for rule in ("sum", "global=1.5")}
    assert runs["global=1.5"].kv_bytes == runs["sum"].kv_bytes
    assert runs["global=1.5"].perplexity != pytest.approx(runs["sum"].perplexity, rel=1e-4)
    assert runs["global=1.5"].label == "h2o [global=1.5] (rolling positions, sliding layers compressed)"
    plain = stream_perplexity(model, ids, capacity=24, chunk=8, positions="rolling", window_tokens=80,
                              progress=False)
    assert plain.kv_bytes == runs["sum"].kv_bytes and not plain.compress_sliding


def test_the_age_summary_reads_the_heavy_hitters_and_the_old_share_exactly():
    """A hand-made histogram with C = 48 (4 C = 192, not a power of two) and R = 12: the old share counts
    exactly the keys aged >= 192, the median is taken over the keys older than R only."""
    edges = age_bin_edges(1000, 12, 192)
    assert edges == [0, 1, 2, 4, 8, 12, 16, 32, 64, 128, 192, 256, 512, 1024]
    ages = [0] * 6 + [5] * 6 + [20] * 3 + [100] * 3 + [200] * 10 + [700] * 20   # 48 keys: 12 recent, 36 chosen
    counts = [sum(lo <= a < hi for a in ages) for lo, hi in zip(edges, edges[1:])]
    run = StreamRun("h2o", "rolling", 48, 8, 0, 1000, 1, 1.0, recent_slots=12, age_edges=edges, age_counts=counts)
    median, old = age_summary(run)
    assert old == pytest.approx(30 / 48)          # the ten keys aged 200 count, though 192 is not a power of two
    assert median == (512, 1024)                  # 36 chosen keys: 3 + 3 + 10 below 512, 20 at 700


@pytest.mark.parametrize("kwargs,match", [
    (dict(policy="full"), "a stream needs an evicting policy"),
    (dict(positions="absolute"), "positions='absolute'"),
    (dict(capacity=0), "capacity=0"),
    (dict(chunk=0), "chunk=0"),
])
def test_bad_stream_settings_are_named(kwargs, match):
    args = dict(capacity=8, chunk=4, policy="h2o", positions="rolling")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        stream_perplexity(build("llama"), torch.arange(1, 20), progress=False, **args)


@pytest.fixture
def text(tmp_path):
    """A word file for the stream command: 3,000 words cycling through 50."""
    path = tmp_path / "words.txt"
    path.write_text(" ".join(f"word{(i * 7) % 50}" for i in range(3000)))
    return path


def test_stream_cli_writes_json_markdown_and_plot(tmp_path, text, capsys):
    out = tmp_path / "stream"
    code = main(["stream", "--model", "tiny", "--text", str(text), "--tokens", "1500", "--budget-slots", "64",
                 "--chunk", "32", "--policy", "h2o,sink", "--positions", "rolling,true", "--window-tokens", "500",
                 "--out", str(out)])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["stream.json", "stream.md", "stream.png", "stream_ages.png"]
    report = json.loads((out / "stream.json").read_text())
    assert [(r["policy"], r["positions"]) for r in report["runs"]] == [
        ("h2o", "rolling"), ("h2o", "true"), ("sink", "rolling"), ("sink", "true")]
    assert all(r["tokens"] == 1500 and len(r["windows"]) == 3 for r in report["runs"])
    assert "| h2o (rolling positions) |" in (out / "stream.md").read_text()
    assert main(["stream", "--model", "tiny", "--text", str(text), "--tokens", "10000000", "--budget-slots", "64",
                 "--out", str(tmp_path / "never")]) == 2
    assert "the texts hold" in capsys.readouterr().err
    assert main(["stream", "--model", "tiny", "--text", str(text), "--tokens", "100", "--budget-slots", "64",
                 "--policy", "full", "--out", str(tmp_path / "never")]) == 2
    assert "--policy ['full']" in capsys.readouterr().err
    assert main(["stream", "--model", "tiny", "--text", str(text), "--tokens", "100", "--budget-slots", "64",
                 "--rules", "sum,snapkv", "--out", str(tmp_path / "never")]) == 2
    assert "score rule 'snapkv'" in capsys.readouterr().err
    assert main(["stream", "--model", "tiny", "--text", str(text), "--tokens", "100", "--budget-slots", "64",
                 "--rules", "global=2", "--out", str(tmp_path / "never")]) == 2
    assert "without compress_sliding (--compress-sliding)" in capsys.readouterr().err
    assert main(["stream", "--model", "tiny", "--text", str(text), "--tokens", "100", "--budget-slots", "64",
                 "--rules", "global=2", "--compress-sliding", "--out", str(tmp_path / "never")]) == 2
    assert "this model has 6 full-attention and 0 sliding-window layers" in capsys.readouterr().err


def test_stream_cli_runs_each_rule_and_reports_ages(tmp_path, text):
    out = tmp_path / "stream"
    assert main(["stream", "--model", "tiny", "--text", str(text), "--tokens", "600", "--budget-slots", "48",
                 "--chunk", "32", "--policy", "h2o,sink", "--rules", "sum,decay=0.9", "--recent-ratio", "0.25",
                 "--window-tokens", "300", "--out", str(out)]) == 0
    report = json.loads((out / "stream.json").read_text())
    assert [(r["policy"], r["rule"]) for r in report["runs"]] == [("h2o", "sum"), ("h2o", "decay=0.9"), ("sink", "-")]
    # every slot of the shipped Llama (full attention only) is filled after 600 tokens: all of them are counted
    config = load_pretrained("tiny")[0].config
    slots = 48 * config.num_hidden_layers * config.num_key_value_heads
    assert all(sum(r["age_counts"]) == slots for r in report["runs"])
    text_md = (out / "stream.md").read_text()
    assert "| h2o [decay=0.9] recent 0.25 (rolling positions) |" in text_md and "median age" in text_md


def test_stream_cli_runs_capped_distances_next_to_rank_numbering(tmp_path, text, capsys):
    out = tmp_path / "stream"
    assert main(["stream", "--model", "tiny", "--text", str(text), "--tokens", "600", "--budget-slots", "48",
                 "--chunk", "32", "--policy", "h2o", "--positions", "rolling,capped", "--max-distance", "100",
                 "--window-tokens", "300", "--out", str(out)]) == 0
    runs = json.loads((out / "stream.json").read_text())["runs"]
    assert [(r["positions"], r["max_distance"]) for r in runs] == [("rolling", 0), ("capped", 100)]
    assert runs[0]["perplexity"] != runs[1]["perplexity"]  # 600 tokens through 48 slots: the numberings differ
    assert "| h2o (distances capped at 100) |" in (out / "stream.md").read_text()
    assert main(["stream", "--model", "tiny", "--text", str(text), "--tokens", "100", "--budget-slots", "48",
                 "--max-distance", "100", "--out", str(tmp_path / "never")]) == 2
    assert "--max-distance 100 caps --positions capped, which is not among rolling" in capsys.readouterr().err
