"""positions="capped" on whole models: keys rotated at their true distance to the block's newest token, capped.

(a) a cap beyond the sequence => the distances are the true ones: greedy generate equals transformers' own,
left padding included; (b) an evicting budget and a cap the stream passes => step logits equal the
in-transformers brute-force simulation: test_rolling_positions.py's evicting test, run for both numberings;
(c) compiled == eager in one graph; (d) a stream runs far past max_position_embeddings; (e) the default cap
and the errors."""

from __future__ import annotations

import pytest
import torch

import h2o_compile

from .arch_configs import VOCAB, build
from .compile_checks import assert_ran_compiled, strict_compile
from .test_rolling_positions import padded_prompts


def op_caps(opt) -> set:
    return {n.kwargs.get("max_distance", 0) for n in opt.graph.graph.nodes
            if n.target is torch.ops.h2o.attention_.default}


@pytest.mark.parametrize("name", ["llama", "gpt_neox", "gemma3", "gpt_oss"])
def test_a_cap_beyond_the_sequence_generates_what_transformers_does(name):
    """72 tokens under a cap of 100: every distance is the true one, so nothing differs from the model."""
    model = build(name)
    opt = h2o_compile.optimize(model, budget=1.0, positions="capped", max_distance=100, compile=False)
    assert op_caps(opt) == {100}
    ids, mask = padded_prompts()
    ours = opt.generate(ids, attention_mask=mask, max_new_tokens=32, pad_token_id=0)
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs), f"first mismatch at {(ours != theirs).nonzero()[:1].tolist()}"


def test_compiled_capped_step_equals_eager_in_one_graph():
    model = build("gemma3")
    ids, mask = padded_prompts()
    eager = h2o_compile.optimize(model, budget=0.3, positions="capped", max_distance=20, compile=False)
    compiled = h2o_compile.optimize(model, budget=0.3, positions="capped", max_distance=20, compile=True)
    with strict_compile():
        for new_tokens in (12, 30):  # two capacities, one compiled step
            want = eager.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=0)
            got = compiled.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=0)
            assert torch.equal(got, want)
        assert_ran_compiled(graphs=1)


def test_a_capped_stream_runs_far_past_the_models_positions():
    """128 trained positions, the default cap 64; 2,000 tokens in chunks of 8 through 24 slots."""
    model = build("llama")  # max_position_embeddings=128
    opt = h2o_compile.optimize(model, budget=24, prefill=8, positions="capped", compile=False)
    assert op_caps(opt) == {64}  # half the model's positions
    opt.reset(1, capacity=24)
    shapes = [tuple(t.shape) for t in opt.state()]
    ids = torch.randint(1, VOCAB, (1, 2000), generator=torch.Generator().manual_seed(2))
    for start in range(0, 2000, 8):
        assert torch.isfinite(opt.step(ids[:, start:start + 8])).all()
    assert [tuple(t.shape) for t in opt.state()] == shapes
    assert opt.kept_positions(0).max().item() == 1999
    whole = h2o_compile.optimize(model, budget=24, positions="capped", compile=False)  # prefill "full"
    whole.reset(1, capacity=24)
    whole.step(ids[:, :30])
    with pytest.raises(ValueError, match="a block of 129 tokens spans distances beyond the model's "
                                         "max_position_embeddings=128"):
        whole.step(ids[:, :129])
    assert whole.stream.seen.tolist() == [30]


@pytest.mark.parametrize("kwargs,match", [
    ({"positions": "rolling", "max_distance": 10}, "max_distance=10 caps the distances of positions='capped'; "
                                                   "positions='rolling' has none"),
    ({"positions": "capped", "max_distance": 0}, "max_distance=0 must be None or an int >= 1"),
    ({"positions": "capped", "max_distance": 128}, "max_distance=128 is beyond the model's positions: allowed "
                                                   "1..127"),
    ({"positions": "absolute"}, "positions='absolute'; allowed: 'true', 'rolling', 'capped'"),
])
def test_bad_capped_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        h2o_compile.optimize(build("llama"), compile=False, **kwargs)


def test_an_export_switching_a_capped_model_to_rank_numbering_drops_its_cap():
    from h2o_compile.export.onnx import _resolve_config

    opt = h2o_compile.optimize(build("llama"), budget=8, positions="capped", max_distance=10, compile=False)
    _, same = _resolve_config(opt, None, {})
    _, switched = _resolve_config(opt, None, {"positions": "rolling"})
    assert (same.positions, same.max_distance) == ("capped", 10)
    assert (switched.positions, switched.max_distance) == ("rolling", None)


def test_stream_runs_check_the_cap_before_the_first_run():
    from h2o_compile.quality.stream import stream_runs

    model, ids = build("llama"), torch.arange(1, 40)
    with pytest.raises(ValueError, match="max_distance=10 caps positions 'capped', which is not among rolling"):
        stream_runs(model, ids, capacity=8, chunk=4, policies=["h2o"], positions=["rolling"], max_distance=10,
                    progress=False)
    with pytest.raises(ValueError, match="max_distance=500 is beyond the model's positions: allowed 1..127"):
        stream_runs(model, ids, capacity=8, chunk=4, policies=["h2o"], positions=["rolling", "capped"],
                    max_distance=500, progress=False, on_run=lambda runs: pytest.fail("a run started"))
