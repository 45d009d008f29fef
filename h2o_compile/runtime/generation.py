"""generate() over any object with ``reset(batch_size, max_seq_len)`` and ``step(input_ids, attention_mask)``.

Shared by H2OModel (PyTorch) and H2OOrtModel (ONNX Runtime) so both take transformers' arguments (a
GenerationConfig plus keyword overrides, logits processors, stopping criteria, a streamer) and return what
transformers returns: the prompt followed by the new tokens, [B, P + n], or a GenerateDecoderOnlyOutput.
Everything that shapes the scores or stops a row is transformers' own class (see generation_setup); the loop
only feeds the H2O cache, picks argmax or ``torch.multinomial`` of the softmax exactly as transformers'
_sample does (so one ``torch.manual_seed`` gives both the same draws), and writes into a preallocated buffer.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
from torch import Tensor

from . import generation_setup as setup


def check_prompt(input_ids, attention_mask) -> Optional[Tensor]:
    """Validate a (left-padded) prompt batch; returns the mask as bool or None."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be an integer tensor [batch, seq_len], got {got}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    mask = attention_mask.bool()
    if not bool(mask[:, -1].all()):
        raise ValueError("attention_mask has padding at the end of a row: pad prompts on the left "
                         "(tokenizer.padding_side = 'left')")
    return mask


def check_token_ids(input_ids: Tensor, vocab_size: Optional[int]) -> None:
    """Token ids outside [0, vocab_size) are a ValueError naming the id (an embedding would raise a bare
    IndexError deep in the graph, or read out of bounds on a GPU)."""
    if vocab_size is None or input_ids.numel() == 0:
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size}) of the model")


def place_block(seen: Tensor, fed: int, max_seq_len: int, input_ids, attention_mask, device,
                vocab_size: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Validate a block for ``step`` and give it positions after what each row has already seen.

    Shared by H2OModel and H2OOrtModel. ``seen`` [B] (valid tokens per row so far) is advanced in place; the
    caller adds T to its own ``fed`` count.
    Returns input_ids [B, T] int64, valid [B, T] bool and positions [B, T] int64, all on ``device``.
    """
    batch = seen.shape[0]
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != batch:
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a tensor [batch={batch}, T] as given to reset(); got {got}")
    t = input_ids.shape[1]
    if t < 1:
        raise ValueError("input_ids has no tokens: give a block of T >= 1")
    if fed + t > max_seq_len:
        raise ValueError(f"{fed} + {t} tokens exceed max_seq_len={max_seq_len} given to reset()")
    if input_ids.device.type == "cpu":  # user input arrives on the CPU; checking a device tensor would sync
        check_token_ids(input_ids, vocab_size)
    input_ids = input_ids.to(device, torch.long)
    if attention_mask is None:
        valid = torch.ones(batch, t, dtype=torch.bool, device=device)
    else:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
                             f"{tuple(input_ids.shape)}")
        valid = attention_mask.to(device).bool()
    positions = (seen[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)        # [B, T]
    seen += valid.sum(1)
    return input_ids, valid, positions


# One lock per model object: a generate call owns the model's single cache from reset to its last step, so
# calls on one model from several threads run one after the other (never reading another call's cache).
_LOCKS: "weakref.WeakKeyDictionary[object, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model) -> threading.Lock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.Lock()
        return lock


def generate(model, input_ids: Tensor, attention_mask: Optional[Tensor] = None, generation_config=None,
             logits_processor=None, stopping_criteria=None, streamer=None, **kwargs):
    """transformers' generate (greedy / sampling) on ``model``'s H2O cache; serialized per model across threads.

    ``model`` gives ``reset``, ``step``, ``device``, ``generation_config`` (its defaults, or None) and
    ``config`` (for max_position_embeddings, or None).

    Args:
        input_ids: [B, P] int prompt ids, left-padded; attention_mask: [B, P] (0 = padding) or None.
        generation_config, logits_processor, stopping_criteria, streamer, **kwargs: as transformers' generate
            (``tokenizer=`` for stop_strings).
    Returns:
        [B * num_return_sequences, P + n] int64 on ``model.device``, n <= max_new_tokens (fewer when every row
        stopped), finished rows padded with pad_token_id; or, with return_dict_in_generate,
        transformers.GenerateDecoderOnlyOutput (sequences, scores / logits as asked; no cache object: the H2O
        cache lives in ``model``).
    """
    with model_lock(model):
        return _generate(model, input_ids, attention_mask, generation_config, logits_processor,
                         stopping_criteria, streamer, kwargs)


@torch.no_grad()
def _generate(model, input_ids, attention_mask, generation_config, logits_processor, stopping_criteria, streamer,
              kwargs):
    from transformers import generation as hf

    mask = check_prompt(input_ids, attention_mask)
    config, extras = setup.prepare_config(getattr(model, "generation_config", None), generation_config, kwargs)
    if input_ids.device.type == "cpu":  # before the move: a check on a GPU tensor would sync
        check_token_ids(input_ids, getattr(model, "vocab_size", None))
    device = model.device
    input_ids = input_ids.to(device, torch.long)
    mask = mask.to(device) if mask is not None else None
    eos, pad = setup.special_tokens(config, device)
    if mask is None:
        mask = setup.infer_mask(input_ids, eos, pad)
    if mask is not None and bool(mask.all()):
        mask = None  # as transformers: an all-ones mask is no mask (the repetition penalty then sees no padding)
    if config.num_return_sequences > 1:
        input_ids = input_ids.repeat_interleave(config.num_return_sequences, dim=0)
        mask = mask.repeat_interleave(config.num_return_sequences, dim=0) if mask is not None else None
    batch, prompt_len = input_ids.shape
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    setup.lengths(config, extras, prompt_len, max_positions)
    processors = setup.logits_processors(config, prompt_len, mask, eos, device, logits_processor)
    criteria = setup.stopping_criteria(config, eos, extras["tokenizer"], max_positions, stopping_criteria)
    # transformers pads finished rows whenever some criterion knows EOS ids (a custom one included).
    pads_finished = any(hasattr(c, "eos_token_id") for c in criteria)
    # Only a criterion that can stop a row before the buffer is full needs checking each step (on a GPU the
    # check waits for the step to finish); the max_length one stops exactly at the buffer's end.
    width = config.max_length
    early = [c for c in criteria if not (isinstance(c, hf.MaxLengthCriteria) and c.max_length >= width)]
    if pads_finished and pad is None:
        raise ValueError("rows that stop early are filled with pad_token_id, but neither pad_token_id nor a "
                         "non-empty eos_token_id is set: pass pad_token_id")
    keep = config.return_dict_in_generate
    scores = () if keep and config.output_scores else None
    raw_logits = () if keep and config.output_logits else None

    tokens_out = torch.empty(batch, width, dtype=torch.long, device=device)   # [B, P + n], filled as we go
    tokens_out[:, :prompt_len] = input_ids
    model.reset(batch, width)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    logits = model.step(input_ids, mask, logits_to_keep=1)[:, -1]             # [B, V]
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    length = prompt_len
    while True:
        # A float32 copy, as transformers takes it (and a compiled step may reuse its output buffer next call).
        raw = logits.to(dtype=torch.float32, copy=True)
        processed = processors(tokens_out[:, :length], raw)                   # [B, V]
        if scores is not None:
            scores += (processed,)
        if raw_logits is not None:
            raw_logits += (raw,)
        if config.do_sample:
            next_ids = torch.multinomial(torch.softmax(processed, dim=-1), num_samples=1).squeeze(1)
        else:
            next_ids = torch.argmax(processed, dim=-1)
        if pads_finished:
            next_ids = next_ids * unfinished + pad * (1 - unfinished)
        tokens_out[:, length] = next_ids
        length += 1
        if early:
            unfinished = unfinished & ~criteria(tokens_out[:, :length], scores)
        if streamer is not None:
            streamer.put(next_ids.cpu())
        if length >= width or (early and not bool(unfinished.any())):
            break
        logits = model.step(next_ids[:, None])[:, -1]
    if streamer is not None:
        streamer.end()
    sequences = tokens_out[:, :length] if length < width else tokens_out
    if not keep:
        return sequences
    return hf.GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=raw_logits)
