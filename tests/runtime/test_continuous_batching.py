"""Continuous batching (h2o_compile/runtime/continuous_batching.py): every request's tokens and kept positions equal the
request run alone through ``generate`` on a second model, whoever shares the batch with it and whenever it
joins or leaves; one compiled decode step serves every mix of rows."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

import h2o_compile
from h2o_compile.runtime import continuous_batching as cb
from h2o_compile.runtime.stream import Stream

from ..helpers import stop_string_tokenizer
from .compile_checks import assert_ran_compiled, strict_compile

VOCAB = 96


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=400,
                                      initializer_range=0.25)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def optimized(llama):
    """optimize(llama, budget, compile=False, **options), built once per setting for the whole module: each
    generate and each manager resets the model's cache, so one model serves the runs alone and the batch."""
    built = {}

    def get(budget, **options):
        key = (budget, *sorted(options.items()))
        if key not in built:
            built[key] = h2o_compile.optimize(llama, budget=budget, compile=False, **options)
        return built[key]

    return get


def _prompts(lengths, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _kept(opt, row: int) -> list[list[list[int]]]:
    """Per layer and KV head, the sorted positions the row holds (the slot order aside: a row of C slots and a
    request alone with min(C, P + n) slots hold the same positions in arrays of different sizes)."""
    return [[sorted(p for p in head.tolist() if p >= 0) for head in opt.kept_positions(layer)[row]]
            for layer in range(opt.limits.num_layers)]


def _serve(manager, schedule: dict[int, list[tuple]], kept: dict, monkeypatch) -> dict:
    """Step ``manager``; before step s add the requests schedule[s] = [(prompt, kwargs)]. ``kept`` receives each
    finished request's kept positions (read just before its row is emptied). Returns {id: output}."""
    original = Stream.reset_row

    def record(stream, row):
        if stream is manager.opt.stream:
            kept[manager._slots[row].id] = _kept(manager.opt, row)
        original(stream, row)

    monkeypatch.setattr(Stream, "reset_row", record)
    results, ids, step = {}, [], 0
    while step <= max(schedule) or manager.pending:
        for prompt, kwargs in schedule.get(step, []):
            ids.append(manager.add_request(prompt, **kwargs))
        results.update({out.request_id: out for out in manager.step()})
        step += 1
    assert sorted(results) == sorted(ids)
    return results


def _alone(opt, prompt, kwargs) -> tuple[list[int], list]:
    """The request alone through generate: its new tokens and (after them) its kept positions."""
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    out = opt.generate(torch.tensor([prompt]), **kwargs)
    return out[0, len(prompt):].tolist(), _kept(opt, 0)


@pytest.mark.parametrize("budget,options", [(160, {}), (8, {}), (8, dict(allocation=(0.5, 1.5))),
                                            (8, dict(allocation=((0.5, 1.5), 1.0)))],
                         ids=["covering", "evicting", "calibrated-split", "head-split"])
def test_requests_joining_and_leaving_equal_each_alone(optimized, monkeypatch, budget, options):
    """Nine requests (prompts of 1-70 tokens, 2-25 new tokens, four ending on their own EOS at different steps, one
    on a stop string) join a batch of three rows at steps 0, 0, 0, 1, 4, 9, 9, 15, 22 and leave when done: each
    one's tokens and kept positions equal it alone, with every slot covering it and with eviction (C = 8; with a
    calibrated split 4 and 12 slots on the two layers; split by KV heads, 4 and 12 on layer 0's heads, 8 on
    layer 1's)."""
    alone = optimized(budget, **options)
    prompts = _prompts([5, 70, 1, 33, 12, 48, 2, 25, 60])
    news = [20, 9, 14, 25, 6, 18, 11, 2, 16]
    kwargs = [dict(max_new_tokens=n) for n in news]
    for i, stop_at in ((0, 7), (3, 2), (5, 12), (8, 4)):  # EOS: the token the request makes at that step alone
        eos = _alone(alone, prompts[i], kwargs[i])[0][stop_at]
        kwargs[i].update(eos_token_id=eos)
    words = _alone(alone, prompts[6], kwargs[6])[0]
    tokenizer = stop_string_tokenizer(VOCAB)
    kwargs[6].update(stop_strings=[f"w{words[5] - 2}"], tokenizer=tokenizer)  # id i is the word w{i-2}
    expected = [_alone(alone, p, k) for p, k in zip(prompts, kwargs)]
    assert [len(t) for t, _ in expected] != news  # some requests really did stop early

    opt = optimized(budget, **options)
    manager = cb.ContinuousBatchingManager(opt, max_batch_size=3)
    joins = [0, 0, 0, 1, 4, 9, 9, 15, 22]
    schedule = {}
    for step, prompt, kw in zip(joins, prompts, kwargs):
        schedule.setdefault(step, []).append((prompt, kw))
    kept = {}
    results = _serve(manager, schedule, kept, monkeypatch)
    for i, (tokens, positions) in enumerate(expected):
        out = results[f"req_{i}"]
        assert out.status == cb.RequestStatus.FINISHED and out.prompt_ids == prompts[i]
        assert out.generated_tokens == tokens, f"request {i}"
        assert kept[f"req_{i}"] == positions, f"request {i}"
    if budget == 8:  # eviction happened: each layer held its slots at most
        held = [[max(len(k[layer][head]) for k in kept.values()) for head in range(2)] for layer in range(2)]
        assert held == {(): [[8, 8], [8, 8]], ((0.5, 1.5),): [[4, 4], [12, 12]],
                        (((0.5, 1.5), 1.0),): [[4, 12], [8, 8]]}[tuple(options.values())]
    assert manager.running == 0 and int(opt.stream.seen.sum()) == 0
    assert all(bool((opt.kept_positions(layer) == -1).all()) for layer in range(2))  # every row freed


def test_init_continuous_batching_takes_transformers_config(optimized):
    from transformers import ContinuousBatchingConfig

    opt = optimized(8)
    config = ContinuousBatchingConfig(max_requests_per_batch=3)
    assert opt.init_continuous_batching(continuous_batching_config=config).rows == 3
    assert opt.init_continuous_batching(None, config, max_batch_size=2).rows == 2  # positional, as transformers'


def test_sampling_with_a_seed_per_request_equals_each_alone(optimized, monkeypatch):
    """do_sample with temperature, top_k and a repetition penalty (a processor that reads the row's own
    tokens): each request draws from its own seeded generator, as torch.manual_seed(seed) + generate alone."""
    alone = optimized(10)
    prompts = _prompts([9, 40, 3, 22, 15], seed=1)
    kwargs = [dict(max_new_tokens=n, do_sample=True, temperature=0.8, top_k=30, repetition_penalty=1.3, seed=s)
              for n, s in zip([12, 7, 15, 10, 9], [11, 12, 13, 14, 15])]
    expected = [_alone(alone, p, k) for p, k in zip(prompts, kwargs)]
    opt = optimized(10)
    manager = opt.init_continuous_batching(max_batch_size=2)
    torch.manual_seed(999)  # the global generator is not what the requests draw from
    results = _serve(manager, {0: [(p, k) for p, k in zip(prompts[:3], kwargs[:3])],
                               3: [(prompts[3], kwargs[3])], 6: [(prompts[4], kwargs[4])]}, {}, monkeypatch)
    assert [results[f"req_{i}"].generated_tokens for i in range(5)] == [t for t, _ in expected]


def test_generate_batch_returns_transformers_outputs_in_input_order(optimized):
    opt = optimized(8)
    alone = optimized(8)
    prompts = _prompts([30, 4, 17, 9], seed=2)
    results = opt.generate_batch(prompts, max_new_tokens=6, max_batch_size=2, record_timestamps=True)
    from transformers.generation.continuous_batching.requests import GenerationOutput

    assert list(results) == ["req_0", "req_1", "req_2", "req_3"]
    for prompt, (rid, out) in zip(prompts, results.items()):
        assert isinstance(out, GenerationOutput) and out.request_id == rid and out.prompt_ids == prompt
        assert out.generated_tokens == _alone(alone, prompt, dict(max_new_tokens=6))[0]
        assert len(out.timestamps) == 6 and out.lifespan[0] <= out.timestamps[0] <= out.lifespan[1]
    assert opt.generate_batch([]) == {}


def test_a_float_budget_sizes_rows_from_max_seq_len(optimized):
    """budget=0.25 with the longest request's P + n = 64: every row holds 16 slots; generate_batch derives that
    length from its inputs, and a request alone of that same length gets the same C and the same tokens."""
    opt = optimized(0.25)
    alone = optimized(0.25)
    prompts = _prompts([54, 54, 54], seed=3)
    results = cb.generate_batch(opt, prompts, max_new_tokens=10)
    assert opt.stream.capacity == 16
    for prompt, out in zip(prompts, results.values()):
        assert out.generated_tokens == _alone(alone, prompt, dict(max_new_tokens=10))[0]
    manager = cb.ContinuousBatchingManager(opt, max_batch_size=2, max_seq_len=64)
    with pytest.raises(ValueError, match="beyond the manager's max_seq_len=64"):
        manager.add_request(prompts[0], max_new_tokens=11)


def test_chunked_prefill_between_decode_steps_equals_alone(optimized, monkeypatch):
    """prefill=8 and prefill_chunk=8: a 70-token prompt goes in one chunk per step while two rows decode; the
    running rows advance during it and every request still equals it alone."""
    alone = optimized(12, prefill=8)
    opt = optimized(12, prefill=8)
    prompts = _prompts([10, 20, 70], seed=4)
    kwargs = [dict(max_new_tokens=n) for n in (15, 15, 6)]
    manager = cb.ContinuousBatchingManager(opt, max_batch_size=3, prefill_chunk=8)
    kept = {}
    results = _serve(manager, {0: [(prompts[0], kwargs[0]), (prompts[1], kwargs[1])], 3: [(prompts[2], kwargs[2])]},
                     kept, monkeypatch)
    for i in range(3):
        tokens, positions = _alone(alone, prompts[i], kwargs[i])
        assert results[f"req_{i}"].generated_tokens == tokens and kept[f"req_{i}"] == positions
    # Steps 0-13 decode the first two; the 70-token prompt takes steps 3-11 (9 chunks), then decodes at steps 11-15.
    # Had it gone in whole at step 3, it would have finished at step 7: 14 decode steps in all.
    assert manager.decode_steps == 16


def test_one_compiled_step_serves_every_mix_of_rows(llama, optimized, monkeypatch):
    """compile=True: after warmup (one empty step) requests of new lengths join and leave without a new graph,
    and the tokens equal the eager model's alone."""
    eager = optimized(8)
    prompts = _prompts([3, 41, 1, 26, 60, 12], seed=5)
    news = [9, 4, 12, 6, 3, 8]
    expected = [_alone(eager, p, dict(max_new_tokens=n))[0] for p, n in zip(prompts, news)]
    opt = h2o_compile.optimize(llama, budget=8, compile=True)
    with strict_compile():
        manager = cb.ContinuousBatchingManager(opt, max_batch_size=3)
        manager.warmup()
        assert_ran_compiled(graphs=1)
        schedule = {0: [(prompts[0], dict(max_new_tokens=news[0]))], 2: [(prompts[1], dict(max_new_tokens=news[1]))],
                    3: [(p, dict(max_new_tokens=n)) for p, n in zip(prompts[2:5], news[2:5])],
                    11: [(prompts[5], dict(max_new_tokens=news[5]))]}
        results = _serve(manager, schedule, {}, monkeypatch)
        assert counters["stats"]["unique_graphs"] == 1
    assert [results[f"req_{i}"].generated_tokens for i in range(6)] == expected


def test_the_background_loop_serves_requests_added_while_it_runs(optimized):
    opt = optimized(8)
    alone = optimized(8)
    prompts = _prompts([6, 19, 33], seed=6)
    manager = cb.ContinuousBatchingManager(opt, max_batch_size=2, max_new_tokens=5)
    manager.start()
    try:
        ids = [manager.add_request(p) for p in prompts]
        partial = manager.add_request(prompts[0], request_id="streamed", streaming=True)
        results, partials = {}, []
        while len(results) < 4:
            out = manager.get_result(timeout=30)
            assert out is not None, "no result within 30 s"
            (results.__setitem__(out.request_id, out) if out.is_finished() else partials.append(out))
    finally:
        manager.stop()
    assert not manager.is_running()
    for rid, prompt in zip([*ids, partial], [*prompts, prompts[0]]):
        assert results[rid].generated_tokens == _alone(alone, prompt, dict(max_new_tokens=5))[0]
    assert [len(p.generated_tokens) for p in partials] == [1, 2, 3, 4]
    assert all(p.request_id == "streamed" and not p.is_finished() for p in partials)


def test_cancel_frees_the_row_and_the_others_go_on(optimized):
    opt = optimized(8)
    alone = optimized(8)
    prompts = _prompts([14, 22], seed=7)
    manager = cb.ContinuousBatchingManager(opt, max_batch_size=2, max_new_tokens=8)
    first, second = (manager.add_request(p) for p in prompts)
    manager.step()
    manager.step()
    manager.cancel_request(first)
    assert manager.running == 1
    assert manager.get_result(timeout=0).error == "cancelled"
    results = manager.run_until_done()
    assert set(results) == {second}
    assert results[second].generated_tokens == _alone(alone, prompts[1], dict(max_new_tokens=8))[0]


def test_a_reset_by_another_call_is_an_error(optimized):
    opt = optimized(8)
    manager = cb.ContinuousBatchingManager(opt, max_batch_size=2, max_new_tokens=4)
    manager.add_request([5, 6, 7])
    opt.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    with pytest.raises(RuntimeError, match="cache was reset"):
        manager.step()


def _add_twice(manager, request_id):
    manager.add_request([1], request_id=request_id)
    manager.add_request([2], request_id=request_id)


@pytest.mark.parametrize("make,error,match", [
    (lambda opt: cb.ContinuousBatchingManager(opt, max_batch_size=0), ValueError, "max_batch_size=0"),
    (lambda opt: cb.ContinuousBatchingManager(opt, capacity=2.5), ValueError, "capacity=2.5"),
    (lambda opt: cb.ContinuousBatchingManager(opt, prefill_chunk=8), ValueError, "prefill_chunk=8 needs"),
    (lambda opt: cb.ContinuousBatchingManager(opt).add_request("hello"), TypeError, "list of token ids"),
    (lambda opt: cb.ContinuousBatchingManager(opt).add_request([]), ValueError, "input_ids is empty"),
    (lambda opt: cb.ContinuousBatchingManager(opt).add_request([1, 500]), ValueError, "token id 500"),
    (lambda opt: cb.ContinuousBatchingManager(opt).add_request([1], num_beams=2), ValueError, "num_beams=2"),
    (lambda opt: cb.ContinuousBatchingManager(opt).add_request([1], num_return_sequences=2, do_sample=True),
     ValueError,
     "num_return_sequences=2"),
    (lambda opt: cb.ContinuousBatchingManager(opt).add_request([1], output_scores=True, return_dict_in_generate=True),
     ValueError, "return_dict_in_generate=True"),
    (lambda opt: cb.ContinuousBatchingManager(opt).add_request([1], seed="x", do_sample=True), TypeError, "seed='x'"),
    (lambda opt: cb.ContinuousBatchingManager(opt).add_request([1], max_new_tokens=500), ValueError,
     "max_position_embeddings"),
    (lambda opt: _add_twice(cb.ContinuousBatchingManager(opt), "a"), ValueError, "request_id='a' is already in use"),
    (lambda opt: cb.generate_batch(opt, [[1]], seeds=[1, 2]), ValueError, "seeds has 2 entries for 1 inputs"),
    (lambda opt: cb.generate_batch(opt, "abc"), TypeError, "inputs must be a list"),
])
def test_bad_input_names_the_value(optimized, make, error, match):
    opt = optimized(8)
    with pytest.raises(error, match=match):
        make(opt)


def test_a_float_budget_without_a_length_is_refused(optimized):
    opt = optimized(0.2)
    with pytest.raises(ValueError, match="budget=0.2 .* give max_seq_len="):
        cb.ContinuousBatchingManager(opt)
    with pytest.raises(ValueError, match="give max_new_tokens"):
        cb.generate_batch(opt, [[1, 2]])
