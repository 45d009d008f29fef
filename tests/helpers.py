"""Small test doubles shared by several test files."""

from __future__ import annotations

import torch


def step_blocks(opt, ids: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """Feed ids [B, S] to an H2OModel in blocks of the given sizes after a reset; the logits [B, S, V]."""
    opt.reset(ids.shape[0], ids.shape[1])
    logits, start = [], 0
    for size in blocks:
        logits.append(opt.step(ids[:, start:start + size]))
        start += size
    return torch.cat(logits, dim=1)


def sink_logits_for(hq, device, seed=11):
    """[Hq] learned sink logits, large enough to take a real share of the softmax."""
    return (torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2.0).to(device)


class CollectStreamer:
    """A transformers-style streamer: put() per chunk of tokens, end() once."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


def stop_string_tokenizer(vocab: int):
    """Words w0..w{vocab-3} as ids 2..vocab-1, for StopStringCriteria: it finds each token's text by decoding it
    after the word "abcdef", so that word is in the vocabulary too (id 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "abcdef"] + [f"w{i}" for i in range(vocab - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def has_compiler() -> bool:
    """Whether a C++ compiler is on this machine (the native ops are built with it on first use)."""
    from h2o_compile.kernels.native_build import NativeBuildError, compiler

    try:
        compiler("")
    except NativeBuildError:
        return False
    return True


def load_benchmark(name: str):
    """The script benchmarks/<name>.py as a module (the scripts are not a package), executed afresh."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def served_rules(backend: str) -> list[str]:
    """Rule specs an op-level test of ``backend`` runs, generated from the capability table
    (h2o_compile/config/capabilities.py): every score it serves, alone and decayed where the score takes a decay, plus a
    decay of 0 (TOVA) on the paper's score. A score added to the table is tested without editing the test."""
    from h2o_compile.config import CAPABILITIES
    from h2o_compile.kernels.rules import SCORES, EvictionRule

    rules = [EvictionRule(decay=0.0)]
    for name, score in SCORES.items():
        if CAPABILITIES[backend].serves_score(name):
            rules.append(EvictionRule(score=name))
            rules += [EvictionRule(score=name, decay=0.8)] if score.decays else []
    return [rule.spec for rule in rules]
