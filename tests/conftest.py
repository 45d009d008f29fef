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

# The files that take minutes (see `make test`'s slowest durations), started first: with
# `--no-loadscope-reorder` (the Makefile), `--dist loadfile` hands out files in collection order, and a slow one
# handed out last would leave the other worker idle at the end.
SLOW_FILES = ("tests/test_cli_end_to_end.py", "tests/bench/test_cuda.py", "tests/export/test_onnx_export.py",
              "tests/runtime/test_gemma3_270m.py", "tests/runtime/test_tensor_parallel.py",
              "tests/kernels/test_triton_models.py", "tests/runtime/test_quantized_model.py",
              "tests/integrations/test_lm_eval.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(SLOW_FILES)))  # stable: the rest in order


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
