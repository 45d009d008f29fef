"""generate() over any object with ``reset(batch_size, max_seq_len)`` and ``step(input_ids, attention_mask)``.

Shared by H2OModel (PyTorch) and H2OOrtModel (ONNX Runtime) so both take transformers' argument names and
return what transformers returns: the prompt followed by the new tokens, [B, prompt_len + new].
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional, Sequence, Union

import torch
from torch import Tensor


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


def _eos_tensor(eos_token_id, device) -> Optional[Tensor]:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None  # [] = never stop early


def next_tokens(logits: Tensor, *, do_sample: bool, temperature: float, top_k: Optional[int],
                top_p: Optional[float], generator: Optional[torch.Generator] = None) -> Tensor:
    """logits [B, V] -> token ids [B]: argmax, or a sample after temperature / top-k / top-p filtering."""
    if not do_sample:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sampling_probs(logits: Tensor, *, temperature: float, top_k: Optional[int], top_p: Optional[float]) -> Tensor:
    """logits [B, V] -> the distribution [B, V] (fp32) sampling draws from: temperature, then top-k, then
    top-p (nucleus), in transformers' order."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def check_generate_args(max_new_tokens, do_sample, temperature, top_k, top_p) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if do_sample and not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature={temperature!r} must be > 0 when sampling")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be None or an int >= 1")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p={top_p!r} must be None or in (0, 1]")


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


def generate(model, *args, **kwargs) -> Tensor:
    """Left-padded batch generation (see :func:`_generate`), serialized per model across threads."""
    with model_lock(model):
        return _generate(model, *args, **kwargs)


@torch.no_grad()
def _generate(model, input_ids: Tensor, attention_mask: Optional[Tensor] = None, *, max_new_tokens: int = 20,
             do_sample: bool = False, temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, eos_token_id: Union[int, Sequence[int], None] = None,
             pad_token_id: Optional[int] = None, streamer=None, generator: Optional[torch.Generator] = None
             ) -> Tensor:
    """Left-padded batch generation; finished rows are filled with ``pad_token_id`` like transformers does.

    Args:
        input_ids: [B, P] prompt ids (left-padded); attention_mask: [B, P] or None.
    Returns:
        [B, P + n] with n <= max_new_tokens (fewer when every row hit an EOS).
    """
    mask = check_prompt(input_ids, attention_mask)
    check_generate_args(max_new_tokens, do_sample, temperature, top_k, top_p)
    eos = _eos_tensor(eos_token_id, input_ids.device)
    if eos is not None and pad_token_id is None:
        pad_token_id = int(eos[0])
    batch, prompt_len = input_ids.shape
    model.reset(batch, prompt_len + max_new_tokens)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    logits = model.step(input_ids, mask, logits_to_keep=1)[:, -1]
    unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
    pieces = [input_ids]
    for i in range(max_new_tokens):
        tokens = next_tokens(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                             generator=generator).to(input_ids.dtype)
        if eos is not None:
            tokens = torch.where(unfinished, tokens, torch.full_like(tokens, pad_token_id))
            unfinished &= ~torch.isin(tokens, eos)
        pieces.append(tokens[:, None])
        if streamer is not None:
            streamer.put(tokens.cpu())
        if eos is not None and not bool(unfinished.any()):
            break
        if i + 1 < max_new_tokens:
            logits = model.step(tokens[:, None])[:, -1]
    if streamer is not None:
        streamer.end()
    return torch.cat(pieces, dim=1)
