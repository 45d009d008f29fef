"""H2OModel.generate against transformers' own model.generate, token for token, with a budget covering the
whole sequence (so nothing is evicted and the two must agree exactly): one table of generate arguments on
the shipped tiny model and two random-weight architectures, and a table of arguments H2O does not serve.

Each row is built from transformers' greedy output on the same prompts (a banned word, an EOS id, a stop
string that greedy decoding would meet), so every row changes what is generated; ``bites`` rows are checked
to differ from plain greedy, which keeps a processor that does nothing from passing."""

from __future__ import annotations

import pytest
import torch
from transformers import (GenerationConfig, LogitsProcessorList, MaxLengthCriteria, RepetitionPenaltyLogitsProcessor,
                          StoppingCriteriaList)

import h2o_compile
from h2o_compile.zoo import load_tiny

from ..helpers import stop_string_tokenizer
from .arch_configs import VOCAB, build

NEW = 10  # new tokens per row: short, to keep the table fast


class Case:
    """A model, its H2O twin at budget 1.0, left-padded prompts [2, P] and transformers' greedy output."""

    def __init__(self, model, tokenizer, ids, mask):
        self.model, self.tokenizer, self.ids, self.mask = model, tokenizer, ids, mask
        self.opt = h2o_compile.optimize(model, budget=1.0, compile=False)
        self.prompt_len = ids.shape[1]
        self.greedy = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)

    def new(self, row: int, step: int) -> int:
        """The token transformers' greedy decoding emits for ``row`` at ``step`` (0 = first new token)."""
        return int(self.greedy[row, self.prompt_len + step])

    def word(self, row: int, step: int) -> str:
        return self.tokenizer.decode([self.new(row, step)])


def tiny_case():
    model, tokenizer = load_tiny()
    batch = tokenizer(["the river ran", "once upon a time the king"], return_tensors="pt", padding=True,
                      padding_side="left")
    return Case(model, tokenizer, batch["input_ids"], batch["attention_mask"])


def random_case(name):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, 8), generator=gen)  # 0-2 are pad / bos / eos ids of these configs
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return Case(build(name, init=0.1), stop_string_tokenizer(VOCAB), ids, mask)


CASES = {"tiny": tiny_case, "gemma": lambda: random_case("gemma"), "gpt_neox": lambda: random_case("gpt_neox")}


@pytest.fixture(scope="module")
def cases():
    built = {}

    def get(name):
        if name not in built:
            built[name] = CASES[name]()
        return built[name]

    return get


# id -> (kwargs builder: Case -> dict, options). Options: bites (must differ from greedy), seed (sampling
# rows reseed torch before each call), defaults (set on the model's generation_config for the call), single
# (the first prompt alone, no attention_mask), pad_ids (the padded row's pad ids replaced, see the row),
# no_length (no max_new_tokens: the length comes from the defaults).
SAMPLE = dict(seed=True, bites=True)
ROWS = {
    "greedy": (lambda c: {}, {}),
    "greedy_single_prompt_no_mask": (lambda c: {}, dict(single=True)),
    "max_length": (lambda c: {"max_length": c.prompt_len + 6}, {}),
    "default_length": (lambda c: {}, dict(no_length=True)),  # transformers' 20 new tokens, and its warning
    "repetition_penalty": (lambda c: {"repetition_penalty": 3.0}, dict(bites=True)),
    # The left padding holds the token greedy decoding emits first in that row: counted as a prompt token,
    # the penalty would push it down (transformers skips the padding).
    "repetition_penalty_pad_is_no_prompt": (lambda c: {"repetition_penalty": 1.5}, dict(bites=True, pad_ids=True)),
    "no_repeat_ngram_size": (lambda c: {"no_repeat_ngram_size": 1}, dict(bites=True)),
    "bad_words_ids": (lambda c: {"bad_words_ids": [[c.new(0, 1)], [c.new(1, 2), c.new(1, 3)]]}, dict(bites=True)),
    "eos_list": (lambda c: {"eos_token_id": [c.new(0, 2), c.new(1, 6)]}, dict(bites=True)),
    "eos_list_min_new_tokens": (lambda c: {"eos_token_id": [c.new(0, 2), c.new(1, 6)], "min_new_tokens": 7},
                                dict(bites=True)),
    "eos_list_pad_token_id": (lambda c: {"eos_token_id": [c.new(0, 1)], "pad_token_id": 1}, dict(bites=True)),
    "stop_strings": (lambda c: {"stop_strings": [c.word(0, 3)], "tokenizer": c.tokenizer}, dict(bites=True)),
    "suppress_tokens": (lambda c: {"suppress_tokens": [c.new(0, 4)], "begin_suppress_tokens": [c.new(1, 0)]},
                        dict(bites=True)),
    "sequence_bias_forced_eos": (lambda c: {"sequence_bias": [[[c.new(0, 0)], -30.0]], "forced_eos_token_id": 3},
                                 dict(bites=True)),
    "length_penalty_renormalize": (lambda c: {"exponential_decay_length_penalty": (2, 3.0),
                                              "renormalize_logits": True, "eos_token_id": [c.new(1, 5)]}, {}),
    "sample": (lambda c: {"do_sample": True}, SAMPLE),  # transformers' default top_k=50 applies
    "sample_temperature_top_k_top_p": (lambda c: {"do_sample": True, "temperature": 1.6, "top_k": 20, "top_p": 0.9},
                                       SAMPLE),
    "sample_min_p_typical": (lambda c: {"do_sample": True, "temperature": 2.0, "min_p": 0.02, "typical_p": 0.95},
                             SAMPLE),
    "num_return_sequences": (lambda c: {"do_sample": True, "temperature": 1.5, "num_return_sequences": 3}, SAMPLE),
    "model_generation_config_defaults": (lambda c: {}, dict(SAMPLE, defaults=dict(do_sample=True, top_k=8,
                                                                                  temperature=1.7))),
    "generation_config_object": (lambda c: {"generation_config": GenerationConfig(
        max_new_tokens=7, repetition_penalty=2.0, no_repeat_ngram_size=2, pad_token_id=0)}, dict(bites=True)),
    "custom_processor_and_criteria": (lambda c: {
        "logits_processor": LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.5)]),
        "stopping_criteria": StoppingCriteriaList([MaxLengthCriteria(c.prompt_len + 5)])}, dict(bites=True)),
    "return_dict_scores_logits": (lambda c: {"do_sample": True, "top_k": 10, "return_dict_in_generate": True,
                                             "output_scores": True, "output_logits": True}, dict(seed=True)),
}


def run(model, case, kwargs, options):
    ids, mask = (case.ids[:1, case.mask[0].bool()], None) if options.get("single") else (case.ids, case.mask)
    if options.get("pad_ids"):
        row = int(case.mask.eq(0).any(1).nonzero()[0])
        ids = ids.clone()
        ids[row, ~case.mask[row].bool()] = case.new(row, 0)
    kwargs = dict(kwargs)
    if not {"max_length", "generation_config"} & kwargs.keys() and not options.get("no_length"):
        kwargs["max_new_tokens"] = NEW
    defaults = case.model.generation_config
    saved = {k: getattr(defaults, k) for k in options.get("defaults", {})}
    try:
        for key, value in options.get("defaults", {}).items():
            setattr(defaults, key, value)
        if options.get("seed"):
            torch.manual_seed(7)
        return model.generate(ids, attention_mask=mask, **kwargs)
    finally:
        for key, value in saved.items():
            setattr(defaults, key, value)


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("name", list(CASES))
def test_generate_equals_transformers(cases, name, row):
    case = cases(name)
    build_kwargs, options = ROWS[row]
    theirs = run(case.model, case, build_kwargs(case), options)
    ours = run(case.opt, case, build_kwargs(case), options)  # fresh processor / criteria objects per call
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.shape == theirs.shape, (ours.shape, theirs.shape)
        assert torch.equal(ours, theirs), f"first mismatch at {(ours != theirs).nonzero()[:1].tolist()}"
    else:
        assert type(ours) is type(theirs)
        assert torch.equal(ours.sequences, theirs.sequences)
        for key in ("scores", "logits"):
            assert len(ours[key]) == len(theirs[key]) == ours.sequences.shape[1] - case.prompt_len
            for a, b in zip(ours[key], theirs[key]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        theirs = theirs.sequences
    if options.get("bites") and not options.get("single"):
        greedy = case.greedy
        same = theirs.shape == greedy.shape and torch.equal(theirs, greedy)
        assert not same, f"{row}: transformers generated plain greedy output; the row tests nothing"


UNSERVED = [
    (dict(num_beams=2), "num_beams=2"),
    (dict(num_beams=2, do_sample=True), "num_beams=2"),
    (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha=0.6"),
    (dict(guidance_scale=1.5), "guidance_scale=1.5"),
    (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens=3"),
    (dict(dola_layers="high"), "dola_layers='high'"),
    (dict(token_healing=True), "token_healing=True"),
    (dict(encoder_repetition_penalty=1.2), "encoder_repetition_penalty=1.2"),
    (dict(return_dict_in_generate=True, output_attentions=True), "output_attentions=True"),
    (dict(return_dict_in_generate=True, output_hidden_states=True), "output_hidden_states=True"),
    (dict(cache_implementation="paged"), "cache_implementation='paged'"),
    (dict(assistant_model=object()), "assistant_model"),
    (dict(prefix_allowed_tokens_fn=lambda batch, ids: [1]), "prefix_allowed_tokens_fn"),
    (dict(negative_prompt_ids=torch.ones(1, 2, dtype=torch.long)), "negative_prompt_ids"),
    (dict(generator=torch.Generator()), "does not serve: generator"),
    (dict(position_ids=torch.zeros(2, 8, dtype=torch.long)), "does not serve: position_ids"),
    (dict(stop_strings=["w5"]), "stop_strings needs the model's tokenizer"),
    (dict(num_return_sequences=2), "num_return_sequences"),  # greedy: transformers' own validation
    (dict(max_new_tokens=0), "max_new_tokens. must be greater than 0"),
    (dict(max_length=8), "max_length. is set to 8"),
    (dict(generation_config={"do_sample": True}), "generation_config must be a transformers.GenerationConfig"),
]


@pytest.mark.parametrize("kwargs,match", UNSERVED, ids=[m for _, m in UNSERVED])
def test_unserved_arguments_raise_value_error_naming_them(cases, kwargs, match):
    case = cases("gemma")
    kwargs = kwargs if "max_length" in kwargs else {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        case.opt.generate(case.ids, attention_mask=case.mask, **kwargs)
    # Refused before the cache was touched: the next call still equals transformers.
    ours = case.opt.generate(case.ids, attention_mask=case.mask, max_new_tokens=3)
    assert torch.equal(ours, case.greedy[:, :case.prompt_len + 3])
