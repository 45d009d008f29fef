"""Shared fixtures: a random-weight model with a word-level tokenizer, saved to a local folder."""

from __future__ import annotations

import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.runtime.arch_configs import VOCAB, build


if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs one worker per core: one torch thread each
    torch.set_num_threads(1)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Tokens w0..w93 plus <unk> and <eos>: text 'w5 w17' encodes to two ids, no training needed."""
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    word_tokenizer().save_pretrained(folder)
    build("llama").save_pretrained(folder)
    return folder
