"""Corpus reading, light text cleanup, byte-level BPE tokenizer training and token streams.

Used by :mod:`h2o_compile.zoo.train` to build the tiny model that ships in ``h2o_compile/assets``.
Everything here is deterministic: the same files give the same split, tokenizer and token ids.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

SPECIAL_TOKEN = "<|endoftext|>"  # one token serves as bos, eos and pad (GPT-2 style)

# wikitext-2 "raw" splits numbers and hyphenated words with "@x@" tokens ("0 @.@ 7", "state @-@ of").
# Undoing them makes the text read like ordinary prose; everything else (" = Heading = " lines, "<unk>",
# spaces before punctuation) is kept as-is because it is consistent across the corpus and cheap to model.
_WIKITEXT_AT = re.compile(r" @([-.,])@ ")
_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE)


def clean_text(text: str) -> str:
    """Light, documented cleanup applied to every corpus file.

    1. CRLF / CR line endings -> ``\\n`` (the Gutenberg book uses CRLF).
    2. Project Gutenberg boilerplate: keep only the text between the ``*** START OF`` and ``*** END OF``
       marker lines when present; otherwise the held-out tail of the book would be the license.
    3. wikitext ``" @-@ "``, ``" @.@ "``, ``" @,@ "`` -> ``"-"``, ``"."``, ``","``.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    text = _WIKITEXT_AT.sub(r"\1", text)
    return text.strip("\n") + "\n"


def split_heldout(text: str, heldout_frac: float = 0.1) -> tuple[str, str]:
    """Split ``text`` into (train, heldout) where heldout is the last ~``heldout_frac`` of its characters.

    The cut moves forward to the next line break (if any) so no word or sentence straddles the split;
    ``train + heldout == text`` always holds.
    """
    if not 0.0 < heldout_frac < 1.0:
        raise ValueError(f"heldout_frac must be in (0, 1), got {heldout_frac!r}")
    cut = int(len(text) * (1.0 - heldout_frac))
    newline = text.find("\n", cut)
    if newline != -1 and newline + 1 < len(text):
        cut = newline + 1
    return text[:cut], text[cut:]


def read_corpus(
    paths: Sequence[str | Path], heldout_frac: float = 0.1, clean: bool = True
) -> tuple[list[str], list[str]]:
    """Read text files and hold out the tail of EACH one.

    Returns ``(train_texts, heldout_texts)``, one entry per file, in the order given. Holding out the tail
    of every file (not whole files) keeps both splits drawn from all sources while the held-out text is
    still never seen in training.
    """
    if not paths:
        raise ValueError("read_corpus needs at least one file path, got an empty list")
    train, heldout = [], []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"corpus file not found: {path}")
        text = path.read_text(encoding="utf-8")
        if clean:
            text = clean_text(text)
        if not text.strip():
            raise ValueError(f"corpus file {path} is empty after cleanup")
        a, b = split_heldout(text, heldout_frac)
        train.append(a)
        heldout.append(b)
    return train, heldout


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (recorded in the model card so the corpus is identifiable)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, max_length: int = 1024):
    """Train a byte-level BPE tokenizer and wrap it as a transformers ``PreTrainedTokenizerFast``.

    Byte-level means every string is encodable (no unknown token). ``<|endoftext|>`` is bos, eos and pad;
    the post-processor prepends it to every encoded sequence, matching how the model is trained (every
    training window starts with it), so the first position is a stable attention sink.
    Save the result with ``save_pretrained``; ``AutoTokenizer.from_pretrained`` loads it back.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + the special token), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    special_id = tok.token_to_id(SPECIAL_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKEN} $A",
        pair=f"{SPECIAL_TOKEN} $A {SPECIAL_TOKEN} $B:1",
        special_tokens=[(SPECIAL_TOKEN, special_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer, texts: Sequence[str]) -> np.ndarray:
    """Token ids of ``texts`` concatenated, each text followed by eos; no bos (windows add their own).

    Returns an int32 array of shape [N].
    """
    eos = tokenizer.eos_token_id
    # The Rust backend directly: the wrapper warns about texts longer than model_max_length, which is
    # expected here (windows are cut later).
    backend = tokenizer.backend_tokenizer
    parts = []
    for text in texts:
        ids = backend.encode(text, add_special_tokens=False).ids
        parts.append(np.asarray(ids, dtype=np.int32))
        parts.append(np.asarray([eos], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
