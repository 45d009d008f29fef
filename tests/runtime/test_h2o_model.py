"""H2OModel's API: state inspection, chunked prefill, sampling, EOS, streamer, and clear errors."""

from __future__ import annotations

import pytest
import torch

import h2o_compile

from ..helpers import CollectStreamer
from .arch_configs import VOCAB, build
from .compile_checks import assert_ran_compiled, strict_compile
from .hf_simulation import simulate_logits


@pytest.fixture(scope="module")
def llama():
    return build("llama", seed=5)


def test_kept_positions_and_cache_bytes(llama):
    opt = h2o_compile.optimize(llama, budget=0.25, compile=False)
    ids = torch.randint(1, VOCAB, (3, 30))
    opt.reset(3, 40)
    assert opt.stream.capacity == 10
    assert torch.all(opt.kept_positions(0) == -1)
    opt.step(ids)
    kept = opt.kept_positions(1)
    assert kept.shape == (3, 2, 10)
    assert torch.all(kept >= 0) and torch.all(kept < 30)
    assert set(range(25, 30)) <= set(kept[0, 0].tolist()), "the recent window (R = 5) is always kept"
    per_layer = 3 * 2 * 10 * (8 + 8) * 4 + 3 * 2 * 10 * (4 + 8)  # head_dim 8; fp32 score + int64 position
    assert opt.kv_cache_bytes() == 2 * per_layer
    assert opt.full_cache_bytes(3, 40) == 2 * 3 * 2 * 40 * 16 * 4


def test_chunked_prefill_equals_simulation_with_the_same_blocks(llama):
    opt = h2o_compile.optimize(llama, budget=7, prefill=4, compile=False)
    ids = torch.randint(1, VOCAB, (2, 16))
    opt.reset(2, 16)
    ours = torch.cat([opt.step(ids[:, :11])] + [opt.step(ids[:, i:i + 1]) for i in range(11, 16)], dim=1)
    want = simulate_logits(llama, ids, [4, 4, 3, 1, 1, 1, 1, 1], capacity=7, recent=4, sinks=0, policy="h2o")
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


def test_sampling_is_seeded_and_top_k_one_is_greedy(llama):
    opt = h2o_compile.optimize(llama, budget=0.5, compile=False)
    ids = torch.randint(1, VOCAB, (2, 6))
    torch.manual_seed(1)
    a = opt.generate(ids, max_new_tokens=8, do_sample=True, top_p=0.9)
    torch.manual_seed(1)
    b = opt.generate(ids, max_new_tokens=8, do_sample=True, top_p=0.9)
    assert torch.equal(a, b)
    greedy = opt.generate(ids, max_new_tokens=8)
    top1 = opt.generate(ids, max_new_tokens=8, do_sample=True, top_k=1, temperature=0.7)
    assert torch.equal(greedy, top1)


def test_eos_stops_and_pads_like_transformers(llama):
    opt = h2o_compile.optimize(llama, budget=1.0, compile=False)
    ids = torch.randint(1, VOCAB, (2, 6))
    free = opt.generate(ids, max_new_tokens=10, eos_token_id=None)
    eos = int(free[0, 8])  # row 0 emits this token at its third step
    ours = opt.generate(ids, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    theirs = llama.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ours, theirs)
    assert ours[0, 9:].eq(0).all()


def test_streamer_sees_prompt_then_each_token(llama):
    opt = h2o_compile.optimize(llama, budget=0.5, compile=False)
    ids = torch.randint(1, VOCAB, (1, 5))
    streamer = CollectStreamer()
    out = opt.generate(ids, max_new_tokens=4, streamer=streamer)
    assert streamer.ended and len(streamer.chunks) == 5
    assert torch.equal(torch.cat([c.view(1, -1) for c in streamer.chunks], dim=1), out)


@pytest.mark.parametrize("call,error,match", [
    (lambda opt: opt.generate(torch.randint(1, VOCAB, (1, 100)), max_new_tokens=40), ValueError,
     "exceeds the model's max_position_embeddings=128"),
    (lambda opt: opt.generate(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 1],
                                                                                                [1, 1, 1, 0]])),
     ValueError, "pad prompts on the left"),
    (lambda opt: opt.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=0), ValueError,
     "max_new_tokens. must be greater than 0"),
    (lambda opt: opt.generate(torch.ones(1, 4)), ValueError, "integer tensor"),
    (lambda opt: opt.generate(torch.ones(1, 4, dtype=torch.long), do_sample=True, temperature=0), ValueError,
     "temperature. .=0. has to be a strictly positive float"),
    (lambda opt: opt.kept_positions(0), RuntimeError, "call reset"),
    (lambda opt: opt.reset(0, 10), ValueError, "batch_size=0"),
    (lambda opt: (opt.reset(2, 8), opt.step(torch.ones(3, 2, dtype=torch.long))), ValueError, "batch=2"),
    (lambda opt: (opt.reset(1, 4), opt.step(torch.ones(1, 5, dtype=torch.long))), ValueError,
     "exceed max_seq_len=4"),
])
def test_errors_are_clear(llama, call, error, match):
    opt = h2o_compile.optimize(llama, budget=0.5, compile=False)
    with pytest.raises(error, match=match):
        call(opt)


@pytest.mark.parametrize("kwargs,match", [
    (dict(budget=2.0), "budget=2.0"),
    (dict(policy="lru"), "policy='lru'"),
    (dict(compile="yes"), "compile='yes'"),
    (dict(compile=1), "compile=1"),
])
def test_optimize_rejects_bad_arguments(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        h2o_compile.optimize(llama, **kwargs)


def test_optimize_rejects_non_models():
    with pytest.raises(TypeError, match="causal LM"):
        h2o_compile.optimize(torch.nn.Linear(2, 2))


def test_sliding_window_on_every_layer_is_served_beyond_the_window():
    """Mistral-style config: ``sliding_window`` without ``layer_types`` makes every layer a sliding one."""
    model = build("mistral")
    model.config.sliding_window = 8
    opt = h2o_compile.optimize(model, budget=1.0, compile=False)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    ours = opt.generate(ids, max_new_tokens=26)
    assert opt.stream.slots == [8, 8]
    theirs = model.generate(ids, max_new_tokens=26, do_sample=False)
    assert torch.equal(ours, theirs)


def test_many_compiled_models_in_one_process_do_not_share_a_recompile_limit(llama):
    """An eval sweep compiles one H2OModel per (policy, budget); dynamo's per-code-object recompile limit
    must not be shared between them (here lowered to 1 so a second model would hit it)."""
    ids = torch.randint(1, VOCAB, (1, 8))
    with torch._dynamo.config.patch(recompile_limit=1):
        for budget in (4, 5):
            opt = h2o_compile.optimize(llama, budget=budget, compile=True)
            opt.reset(1, 8)
            opt.step(ids[:, :6])
            opt.step(ids[:, 6:7])
            opt.step(ids[:, 7:8])
            assert opt.kept_positions(0).ge(0).sum(-1).eq(budget).all()


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compile_modes_decode_like_eager(llama, mode):
    """A torch.compile mode string: "reduce-overhead" (CUDA graphs on GPU; on CPU Inductor skips them) and
    "max-autotune" (on CPU with frozen, prepacked weights) decode like eager."""
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    logits = {}
    for compile in (False, mode):
        opt = h2o_compile.optimize(llama, budget=5, compile=compile)
        opt.reset(2, 9)
        opt.step(ids[:, :6])
        with strict_compile():
            logits[compile] = [opt.step(ids[:, i:i + 1]) for i in range(6, 9)]
            assert_ran_compiled(graphs=1 if compile else 0)
    for eager, compiled in zip(logits[False], logits[mode]):
        torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_generate_from_several_threads_is_serialized_and_never_mixes_caches(llama):
    """One H2OModel, one cache: concurrent generate calls run one after the other, each with its own result."""
    import threading

    opt = h2o_compile.optimize(llama, budget=0.5, compile=False)
    gen = torch.Generator().manual_seed(8)
    requests = [torch.randint(1, VOCAB, (batch, length), generator=gen) for batch, length in
                [(1, 5), (3, 17), (2, 9), (4, 30), (1, 40), (2, 3)]]
    alone = [opt.generate(ids, max_new_tokens=12, eos_token_id=[]) for ids in requests]
    results, errors = [None] * len(requests), []
    start = threading.Barrier(len(requests))

    def serve(i):
        try:
            start.wait()
            results[i] = opt.generate(requests[i], max_new_tokens=12, eos_token_id=[])
        except Exception as err:  # noqa: BLE001  (reported below)
            errors.append(err)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for got, want in zip(results, alone):
        assert torch.equal(got, want)


def test_a_stream_with_a_fixed_capacity_keeps_its_memory_and_equals_the_bounded_cache(llama):
    """reset(B, capacity=C) without max_seq_len: 30 chunks of 4 tokens through 8 slots; the state tensors never
    grow, the logits are those of a cache sized for the whole sequence with the same 8 slots, and the stream
    warns when it passes the model's positions."""
    opt = h2o_compile.optimize(llama, budget=8, prefill=4, compile=False)
    ids = torch.randint(1, VOCAB, (2, 120), generator=torch.Generator().manual_seed(6))
    opt.reset(2, capacity=8)
    shapes = [tuple(t.shape) for t in opt.state()]
    assert all(shape[2] == 8 for shape in shapes)
    stream = []
    for start in range(0, 120, 4):
        stream.append(opt.step(ids[:, start:start + 4]))
        assert [tuple(t.shape) for t in opt.state()] == shapes
    bounded = h2o_compile.optimize(llama, budget=8, prefill=4, compile=False)
    bounded.reset(2, 120)
    want = torch.cat([bounded.step(ids[:, s:s + 4]) for s in range(0, 120, 4)], dim=1)
    torch.testing.assert_close(torch.cat(stream, dim=1), want, rtol=0, atol=0)
    assert torch.equal(opt.kept_positions(1), bounded.kept_positions(1))
    with pytest.warns(UserWarning, match="passes the model's max_position_embeddings=128 with true positions"):
        opt.step(ids[:, :12])  # a rotary model may go on (extrapolating); positions="rolling" stays inside
    with pytest.raises(ValueError, match="either max_seq_len .* or capacity"):
        opt.reset(2)
    with pytest.raises(ValueError, match="capacity=0"):
        opt.reset(2, capacity=0)
