"""The real pretrained Gemma 3 270M (the ``gemma`` extra, which ``make test`` installs): hybrid sliding /
global attention served past its 512-token window, token for token with transformers."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest
import torch

import h2o_compile
from h2o_compile import zoo

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "data" / "books" / "war_and_peace.txt"


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip(zoo.gemma.GEMMA3_PACKAGE, reason="the gemma extra is not installed")
    return zoo.load_gemma3_270m()


def test_600_token_prompt_32_greedy_tokens_equal_transformers(gemma):
    model, tokenizer = gemma
    assert model.config.layer_types.count("sliding_attention") == 15 and model.config.sliding_window == 512
    text = CORPUS.read_text(encoding="utf-8")[200_000:260_000] if CORPUS.is_file() else \
        " ".join(f"Line {i} of a long letter about the war, the harvest and the family." for i in range(200))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :600]
    assert ids.shape[1] == 600
    opt = h2o_compile.optimize(model, budget=1.0, compile=False)
    ours = opt.generate(ids, max_new_tokens=32)
    theirs = model.generate(ids, max_new_tokens=32, do_sample=False)
    assert torch.equal(ours, theirs), f"first mismatch at {(ours != theirs).nonzero()[:1].tolist()}"
    # 15 sliding layers hold their 512-token window, the 3 global layers the whole 632 tokens.
    assert opt.stream.slots == [632 if kind == "full_attention" else 512 for kind in model.config.layer_types]


def test_missing_weights_package_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_gemma(name, *args, **kwargs):
        if name.startswith(zoo.gemma.GEMMA3_PACKAGE):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gemma)
    with pytest.raises(ImportError, match=r"pip install 'h2o-compile\[gemma\]'"):
        zoo.load_gemma3_270m()


def test_a_gguf_path_that_is_not_a_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a .gguf file"):
        zoo.load_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="unknown model 'gemma4'; known: gemma3-270m, tiny"):
        zoo.load_model("gemma4")
