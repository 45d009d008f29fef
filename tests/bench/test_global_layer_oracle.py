"""benchmarks/global_layer_oracle.py: its one-pass replay of an eviction process (a mask per full-attention
layer) must give the library's own teacher-forced NLL for the policies it imitates exactly, on a hybrid model
whose sliding layers keep their window."""

from __future__ import annotations

import pytest
import torch

import h2o_compile
from h2o_compile.quality.evaluation import streaming_nll

from ..helpers import load_benchmark
from ..runtime.arch_configs import VOCAB, build

LENGTH, PROMPT, SLOTS = 48, 8, 12


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("global_layer_oracle")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("policy", ["sink", "local"])
def test_replay_matches_the_library(probe, ids, policy):
    library, _ = streaming_nll(h2o_compile.optimize(build("gemma3"), budget=SLOTS, policy=policy, compile=False),
                               ids, PROMPT)
    replay_model = build("gemma3")
    replay_model.config._attn_implementation = "eager"
    full_layers = [i for i, kind in enumerate(replay_model.config.layer_types) if kind == "full_attention"]
    masks = {i: probe.visible_keys(LENGTH, SLOTS, PROMPT, probe.make_process(policy, None, None))
             for i in full_layers}
    assert probe.window_nll(replay_model, ids[0], PROMPT, masks) == pytest.approx(library, rel=1e-5)
    # the masks matter: without them the replay is the full cache, which differs
    assert probe.window_nll(replay_model, ids[0], PROMPT, {}) != pytest.approx(library, rel=1e-3)


def test_visible_keys_is_an_eviction_process(probe):
    scores = torch.rand(LENGTH, generator=torch.Generator().manual_seed(0))
    process = probe.Fixed(lambda t, keys: scores[keys])
    seen = probe.visible_keys(LENGTH, SLOTS, PROMPT, process, recent=3)
    assert torch.equal(seen[:PROMPT, :PROMPT], torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril())
    rows = [set(seen[t].nonzero().flatten().tolist()) for t in range(LENGTH)]
    for t in range(PROMPT, LENGTH):
        assert len(rows[t]) == min(t + 1, SLOTS + 1) and max(rows[t]) == t
        assert set(range(max(0, t - 3), t + 1)) <= rows[t]                 # the recent window stays
    for t in range(PROMPT, LENGTH - 1):
        kept = rows[t + 1] - {t + 1}
        assert kept <= rows[t]                                              # an evicted key never returns
        evictable = {p for p in kept if p <= t - 3}
        # what left is what the priority ranks lowest among the keys it could evict
        assert all(scores[gone] <= scores[stay] for gone in rows[t] - kept for stay in evictable)


def test_accumulated_decay_matches_its_formula(probe):
    probs = torch.rand(6, 6, generator=torch.Generator().manual_seed(1)).tril()
    process = probe.Scored(probs, decay=0.5)
    for t in range(6):
        process.observe(t, torch.arange(t + 1))
    expected = sum(0.5 ** (5 - t) * probs[t].double() / probs[t].sum() for t in range(6))
    assert torch.allclose(process.score, expected)


def test_decayed_peak_matches_its_formula(probe):
    probs = torch.rand(6, 6, generator=torch.Generator().manual_seed(2)).tril()
    process = probe.Scored(probs, decay=0.5, update="max")
    for t in range(6):
        process.observe(t, torch.arange(t + 1))
    expected = torch.stack([0.5 ** (5 - t) * probs[t].double() / probs[t].sum() for t in range(6)]).amax(0)
    assert torch.allclose(process.score, expected)


@pytest.mark.parametrize("name", ["bogus", "lookahead=x", "lookahead=0", "max=2", "decay=abc"])
def test_bad_process_is_a_clear_error(probe, name):
    with pytest.raises(ValueError, match="allowed: full, sink"):
        probe.make_process(name, None, None)


def test_every_documented_process_parses(probe):
    for name in ["full", "sink", "local", "oracle", "lookahead=64", "h2o", "mean", "decay=0.97", "max=0.99",
                 "count=1"]:
        assert probe.parse_process(name)[0] == name.partition("=")[0]


def test_bad_process_fails_before_the_model_loads(probe, tmp_path, capsys):
    with pytest.raises(SystemExit):
        probe.main(["--text", str(tmp_path / "none.txt"), "--processes", "oracle,max=7", "--out", str(tmp_path)])
    assert "--processes: process 'max=7'" in capsys.readouterr().err
