"""Compile once, serve every request: one compiled decode step for every prompt length, capacity and batch size
(dynamo's counters), equal to eager, and nothing left to compile after ``warmup``."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

import h2o_compile
from h2o_compile.runtime.compiling import compile_step

from .compile_checks import assert_ran_compiled, strict_compile

VOCAB = 96


@pytest.fixture(scope="module")
def long_llama():
    """A two-layer Llama that knows 1100 positions, so prompts of up to 1000 tokens fit."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1100,
                                      initializer_range=0.25)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _request(rng: random.Random, gen: torch.Generator):
    """A left-padded batch of 1-8 prompts of 50-1000 tokens."""
    batch, length = rng.randint(1, 8), rng.randint(50, 1000)
    ids = torch.randint(1, VOCAB, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        mask[row, :rng.randint(0, length // 4)] = 0
    return ids, mask


def test_twenty_requests_of_new_lengths_and_batch_sizes_compile_one_step(long_llama):
    """20 generate calls with prompt lengths drawn from 50-1000 and batch sizes 1-8: every one needs a new
    capacity, yet dynamo compiles a single graph, and every output equals the eager model's."""
    compiled = h2o_compile.optimize(long_llama, budget=0.2, compile=True)
    eager = h2o_compile.optimize(long_llama, budget=0.2, compile=False)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    capacities = set()
    with strict_compile():
        for _ in range(20):
            ids, mask = _request(rng, gen)
            ours = compiled.generate(ids, mask, max_new_tokens=4)
            capacities.add((ids.shape[0], compiled.stream.capacity))
            assert torch.equal(ours, eager.generate(ids, mask, max_new_tokens=4))
        assert_ran_compiled(graphs=1)
    assert len(capacities) >= 15  # the calls really did have many different (batch, capacity) shapes


@pytest.mark.parametrize("policy,sinks", [("h2o", 0), ("h2o", 2), ("local", 0), ("sink", 4), ("random", 0)])
def test_one_compiled_step_keeps_what_eager_keeps_across_capacities(long_llama, policy, sinks):
    """Three requests with different capacities and batch sizes through one compiled step, every policy: the
    kept positions and scores after evicting decode steps equal the eager model's (whose recent window is a
    graph constant set per request)."""
    compiled = h2o_compile.optimize(long_llama, budget=0.3, policy=policy, sink_tokens=sinks, compile=True)
    eager = h2o_compile.optimize(long_llama, budget=0.3, policy=policy, sink_tokens=sinks, compile=False)
    gen = torch.Generator().manual_seed(1)
    with strict_compile():
        for batch, prompt in ((3, 40), (1, 23), (5, 61)):
            ids = torch.randint(1, VOCAB, (batch, prompt + 12), generator=gen)
            mask = torch.ones(batch, prompt, dtype=torch.long)
            mask[1:, :5] = 0
            for opt in (compiled, eager):
                opt.reset(batch, prompt + 12)
                opt.step(ids[:, :prompt], mask)
            for i in range(prompt, prompt + 12):
                torch.testing.assert_close(compiled.step(ids[:, i:i + 1]), eager.step(ids[:, i:i + 1]),
                                           rtol=1e-4, atol=1e-4)
            for layer in range(2):
                assert torch.equal(compiled.kept_positions(layer), eager.kept_positions(layer))
        assert_ran_compiled(graphs=1)


def test_no_compile_after_warmup(long_llama):
    opt = h2o_compile.optimize(long_llama, budget=0.2, compile=True)
    torch._dynamo.reset()
    counters.clear()
    assert opt.warmup(batch_sizes=[1, 4], max_seq_lens=[64, 700], progress=False) == 1
    assert opt.stream is None  # warmup leaves no request behind
    graphs = counters["stats"]["unique_graphs"]
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    for _ in range(4):
        ids, mask = _request(rng, gen)
        opt.generate(ids, mask, max_new_tokens=3)
    assert counters["stats"]["unique_graphs"] == graphs
    assert opt.warmup(batch_sizes=2, max_seq_lens=100, progress=False) == 0  # already warm


def test_warmup_is_a_no_op_without_compilation_and_checks_its_sizes(long_llama):
    opt = h2o_compile.optimize(long_llama, budget=0.2, compile=False)
    assert opt.warmup(batch_sizes=[2], max_seq_lens=[50], progress=False) == 0
    with pytest.raises(ValueError, match=r"batch_sizes=\[0\] must be ints >= 1"):
        opt.warmup(batch_sizes=[0])
    with pytest.raises(ValueError, match=r"max_seq_lens=\[\] must be ints >= 1"):
        opt.warmup(max_seq_lens=[])


def test_unfused_step_takes_its_recent_window_at_run_time(long_llama):
    """The GPU decode step compiles the runtime graph itself (the opaque h2o op, which gets the recent window as
    an int input); compiled with the runtime's dynamic sources, two capacities share one graph and match eager."""
    eager = h2o_compile.optimize(long_llama, budget=0.25, compile=False)
    step = compile_step(eager.graph, "default", torch.device("cpu"), dynamic=True)
    gen = torch.Generator().manual_seed(3)
    with strict_compile(), torch.no_grad():
        for batch, total in ((2, 40), (3, 96)):
            ids = torch.randint(1, VOCAB, (batch, total), generator=gen)
            reference = h2o_compile.optimize(long_llama, budget=0.25, compile=False)
            for opt in (eager, reference):
                opt.reset(batch, total)
                opt.step(ids[:, :total - 6])
            recent = eager.stream.recent
            assert len(set(recent)) == 1 and recent[0] == round(0.25 * total / 2)
            for i in range(total - 6, total):
                token = ids[:, i:i + 1]
                positions = torch.full((batch, 1), i, dtype=torch.long)
                valid = torch.ones(batch, 1, dtype=torch.bool)
                ours = step(token, positions, valid, *eager.state(), *recent)
                eager.stream.fed += 1
                torch.testing.assert_close(ours, reference.step(token), rtol=1e-4, atol=1e-4)
            for layer in range(2):
                assert torch.equal(eager.kept_positions(layer), reference.kept_positions(layer))
        assert_ran_compiled(graphs=1)


@pytest.mark.parametrize("prefill", ["full", 16])
def test_last_position_logits_equal_the_full_logits_and_leave_the_same_cache(long_llama, prefill):
    """step(logits_to_keep=1), what generate uses for the prompt, projects only the last position: the same
    logits as the last row of the full [B, T, V] and the same cache afterwards, in one block or in chunks;
    a second request (new capacity, new recent window) rebuilds it from the current parameters."""
    full = h2o_compile.optimize(long_llama, budget=0.25, prefill=prefill, compile=False)
    last = h2o_compile.optimize(long_llama, budget=0.25, prefill=prefill, compile=False)
    gen = torch.Generator().manual_seed(4)
    for batch, prompt in ((2, 60), (3, 100)):
        ids = torch.randint(1, VOCAB, (batch, prompt), generator=gen)
        mask = torch.ones(batch, prompt, dtype=torch.long)
        mask[0, :7] = 0
        for opt in (full, last):
            opt.reset(batch, prompt + 8)
        expected = full.step(ids, mask)[:, -1:]
        ours = last.step(ids, mask, logits_to_keep=1)
        assert ours.shape == (batch, 1, VOCAB)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
        for a, b in zip(full.state(), last.state()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"logits_to_keep=2; allowed: 0 \(every position\) or 1"):
        last.step(ids[:, :1], logits_to_keep=2)


def test_a_cpu_compile_trusts_the_cpu_flags_once_the_native_ops_are_built():
    """Inductor's per-process probe of the vector instruction sets (a compile and a load per set) is skipped on
    CPU when the native ops built with -march=native; kept on other devices and where they are not built."""
    from h2o_compile.runtime.compiling import _patches
    from h2o_compile.kernels import native_cpu

    def trusts(device: str) -> bool:
        seen = []
        for patch in _patches("default", torch.device(device), dynamic=False):
            with patch:
                seen.append(torch._inductor.config.cpp.vec_isa_ok)
        return True in seen

    assert trusts("cpu") is native_cpu.available()
    assert not trusts("meta")
    with native_cpu.disabled():
        assert not trusts("cpu")
