"""The streaming evaluation: its perplexity against transformers' own logits, its windows, its report and CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from h2o_compile.cli import main
from h2o_compile.quality.stream import stream_perplexity
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


def test_stream_cli_writes_json_markdown_and_plot(tmp_path, capsys):
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"word{(i * 7) % 50}" for i in range(3000)))
    out = tmp_path / "stream"
    code = main(["stream", "--model", "tiny", "--text", str(text), "--tokens", "1500", "--budget-slots", "64",
                 "--chunk", "32", "--policy", "h2o,sink", "--positions", "rolling,true", "--window-tokens", "500",
                 "--out", str(out)])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["stream.json", "stream.md", "stream.png"]
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
