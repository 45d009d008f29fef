"""Tests of h2o_compile.zoo: corpus split, tokenizer, training loop, save/reload, the shipped tiny model.

Everything runs on a small generated corpus with a tiny config, a few seconds per test.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from h2o_compile import zoo
from h2o_compile.zoo.train import (
    FP16_BUDGET_BYTES,
    TrainConfig,
    build_llama_config,
    clean_text,
    encode_stream,
    evaluate,
    llama_param_count,
    read_corpus,
    run_training,
    sample_batch,
    save_fp16,
    split_heldout,
    train_model,
    train_tokenizer,
)

TINY = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "max_position_embeddings": 128}


def _synthetic_text(seed: int, n_sentences: int = 600) -> str:
    """Repetitive, learnable text: sentences from a tiny grammar, paragraphs of 5 sentences."""
    rng = np.random.default_rng(seed)
    subjects = ["the cat", "a dog", "the old man", "my sister", "the soldier", "a bird"]
    verbs = ["sees", "likes", "follows", "finds", "hears", "carries"]
    objects = ["the ball", "a red apple", "the river", "the small house", "a letter", "the moon"]
    lines = []
    for i in range(n_sentences):
        s, v, o = rng.choice(subjects), rng.choice(verbs), rng.choice(objects)
        lines.append(f"{s} {v} {o} .")
        if i % 5 == 4:
            lines.append("\n")
    return " ".join(lines).replace(" \n ", "\n")


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    paths = []
    for i in range(2):
        p = folder / f"part{i}.txt"
        p.write_text(_synthetic_text(seed=i))
        paths.append(p)
    return paths


@pytest.fixture(scope="module")
def tokenizer(corpus_files):
    train_texts, _ = read_corpus(corpus_files)
    return train_tokenizer(train_texts, vocab_size=300, max_length=128)


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    from transformers import LlamaForCausalLM

    cfg = build_llama_config(
        len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, **TINY
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def test_clean_text_wikitext_gutenberg_crlf():
    raw = (
        "header\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\n"
        "a state @-@ of @-@ the @-@ art 1 @,@ 000 and 0 @.@ 7 kg\r\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nlicense text\r\n"
    )
    assert clean_text(raw) == "a state-of-the-art 1,000 and 0.7 kg\n"
    assert clean_text(" = Heading = \n") == " = Heading = \n"  # headings are kept on purpose


def test_heldout_is_the_tail_of_each_text(corpus_files):
    train, heldout = read_corpus(corpus_files, heldout_frac=0.1)
    assert len(train) == len(heldout) == len(corpus_files)
    for path, a, b in zip(corpus_files, train, heldout):
        text = clean_text(path.read_text())
        assert a + b == text and text.endswith(b)
        assert 0.08 < len(b) / len(text) < 0.12  # ~10%, moved forward to a line break
        assert a.endswith("\n")
    a, b = split_heldout("x" * 100, 0.25)  # no line break: exact character cut
    assert (len(a), len(b)) == (75, 25)
    with pytest.raises(ValueError, match="heldout_frac"):
        split_heldout("abc", 1.5)
    with pytest.raises(FileNotFoundError):
        read_corpus([corpus_files[0].parent / "missing.txt"])


def test_tokenizer_prepends_bos_and_round_trips(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    text = "the cat sees a red apple .\nthe dog sings"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(tokenizer) <= 300
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded(text)["input_ids"] == ids
    stream = encode_stream(tokenizer, ["ab", "cd"])
    assert stream.dtype == np.int32 and (stream == tokenizer.eos_token_id).sum() == 2


def test_build_llama_config_defaults():
    cfg = build_llama_config(8192, 0, 0, 0)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        6,
        256,
        8,
        2,
    )
    assert cfg.intermediate_size == 688 and cfg.intermediate_size % 8 == 0
    assert cfg.max_position_embeddings == 1024
    # Untied, vocab 8192 would be ~16.7 MB in fp16: the builder ties to stay under the budget.
    assert cfg.tie_word_embeddings and 2 * llama_param_count(cfg) <= FP16_BUDGET_BYTES
    assert not build_llama_config(512, 0, 0, 0).tie_word_embeddings
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_llama_config(8192, 0, 0, 0, num_heads=8, num_kv_heads=3)


def test_param_count_matches_model(tiny_model):
    assert llama_param_count(tiny_model.config) == sum(p.numel() for p in tiny_model.parameters())


def test_sample_batch_and_evaluate_count(tiny_model):
    stream = np.arange(1, 101, dtype=np.int32)
    inputs, targets = sample_batch(stream, 16, 3, bos_id=0, rng=np.random.default_rng(0))
    assert inputs.shape == targets.shape == (3, 16)
    assert (inputs[:, 0] == 0).all() and torch.equal(inputs[:, 1:], targets[:, :-1])
    assert (targets[:, 1:] - targets[:, :-1] == 1).all()  # contiguous windows
    nll, count = evaluate(tiny_model, stream, seq_len=32, bos_id=0)
    assert count == 100 and math.isfinite(nll)  # 3 full windows + a tail of 4, every token once
    with pytest.raises(ValueError, match="seq_len"):
        sample_batch(stream[:10], 16, 1, 0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)


def test_training_loss_goes_down(corpus_files, tokenizer, tmp_path):
    from transformers import LlamaForCausalLM

    train_texts, heldout_texts = read_corpus(corpus_files)
    stream = encode_stream(tokenizer, train_texts)
    heldout = encode_stream(tokenizer, heldout_texts)
    cfg = build_llama_config(
        len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, **TINY
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    tc = TrainConfig(
        seq_len=64,
        batch_size=8,
        lr=3e-3,
        warmup_steps=5,
        max_steps=60,
        eval_every=30,
        eval_windows=4,
        log_every=10,
        seed=0,
    )
    log = tmp_path / "log.txt"
    result = train_model(model, stream, heldout, tokenizer.bos_token_id, tc, log_path=log, progress_bar=False)
    assert result.steps == 60 and result.tokens_seen == 60 * 8 * 64
    first, last = np.mean(result.losses[:10]), np.mean(result.losses[-10:])
    assert last < first - 1.0, (first, last)
    assert [s for s, _ in result.evals] == [30, 60] and result.evals[1][1] < result.evals[0][1]
    lines = log.read_text().splitlines()
    assert sum(line.startswith("step ") for line in lines) == 6
    assert "tok/s" in lines[1] and "elapsed" in lines[1]


def test_time_budget_stops_training(tokenizer, tiny_model):
    stream = np.arange(1, 200, dtype=np.int32) % len(tokenizer)
    tc = TrainConfig(seq_len=16, batch_size=2, minutes=1e-4, eval_every=1000)  # 6 ms budget
    result = train_model(tiny_model, stream, None, 0, tc, progress_bar=False)
    assert 1 <= result.steps < 1000 and result.seconds < 30


def test_save_reload_round_trip(tiny_model, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = save_fp16(tiny_model, tokenizer, tmp_path)
    assert weights.name == "model.safetensors" and weights.is_file()
    assert next(tiny_model.parameters()).dtype == torch.float32  # the caller's model is untouched
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, local_files_only=True)
    assert next(reloaded.parameters()).dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = torch.tensor([tok("the old man finds the moon .")["input_ids"]])
    ref = tiny_model.to(torch.float16).float()  # what was saved: weights rounded to fp16
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded.eval()(input_ids=ids).logits, ref.eval()(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )


def test_run_training_writes_asset_and_card(corpus_files, tmp_path):
    cfg = TrainConfig(seq_len=64, batch_size=4, max_steps=3, warmup_steps=1, eval_every=2, eval_windows=2)
    summary = run_training(
        [str(p) for p in corpus_files],
        tmp_path,
        cfg,
        vocab_size=300,
        model_kwargs=TINY,
        command="pytest",
        train_eval_windows=4,
        progress_bar=False,
    )
    for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md", "train_log.txt"):
        assert (tmp_path / name).is_file(), name
    card = (tmp_path / "README.md").read_text()
    assert "pytest" in card and summary["corpus"][0]["sha256"] in card and "{" not in card.split("```")[-1]
    assert f"{summary['heldout_ppl']:.2f}" in card and summary["tokens_seen"] == 3 * 4 * 64
    assert json.loads((tmp_path / "train_summary.json").read_text())["steps"] == 3


def test_load_tiny_missing_asset(tmp_path, monkeypatch):
    monkeypatch.setattr(zoo.loading, "TINY_LLAMA_DIR", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        zoo.load_tiny()


@pytest.mark.skipif(
    not (zoo.TINY_LLAMA_DIR / "model.safetensors").is_file(),
    reason=f"tiny model not trained yet ({zoo.TINY_LLAMA_DIR}); run benchmarks/train_tiny_lm.py",
)
def test_load_tiny_shipped_model():
    assert (zoo.TINY_LLAMA_DIR / "model.safetensors").stat().st_size <= FP16_BUDGET_BYTES
    model, tokenizer = zoo.load_tiny()
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert model.config.max_position_embeddings == 1024
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    ids = torch.tensor(
        [tokenizer("It was in July, 1805, and the speaker was the well-known Anna")["input_ids"]]
    )
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    # A trained model: the text it was (partly) trained on is far more likely than uniform.
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    assert nll < math.log(len(tokenizer)) - 2.0
    half, _ = zoo.load_tiny(dtype=torch.float16)
    assert next(half.parameters()).dtype == torch.float16
