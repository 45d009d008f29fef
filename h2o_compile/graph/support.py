"""Which models the attention pass can serve, decided from the config before anything is traced."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

# Position biases added to the attention logits: the bias of an evicted key depends on distances the cache
# no longer keeps consistent, and these models carry it in an additive mask we would drop.
_ALIBI_MODEL_TYPES = ("bloom", "mpt", "falcon_alibi")


# Said by every refusal of a model that is not a causal LM.
ACCEPTED = ("accepted: a decoder-only causal LM with its LM head, as AutoModelForCausalLM loads it (e.g. "
            "LlamaForCausalLM, Gemma3ForCausalLM, GPT2LMHeadModel)")
_PROBE_TOKENS = 6


class UnsupportedModelError(ValueError):
    """The model has an attention variant the H2O pass cannot serve; the message names it."""


# transformers' `layer_types` entries the pass serves; anything else (chunked, linear attention) declines.
_FULL_KINDS = ("full_attention",)
_SLIDING_KINDS = ("sliding_attention",)


@dataclass(frozen=True)
class ModelLimits:
    """What the config says about the model's attention, per layer and as a whole."""

    num_layers: int
    max_positions: Optional[int]
    windows: Sequence[int]  # per layer: sliding window W, 0 for a full-attention layer
    softcap: float = 0.0    # attention logit soft-capping (every layer), 0 = none
    rotary: bool = False    # every layer rotates q and k as x * cos + rotate_half(x) * sin (found in the graph)

    @property
    def sliding_window(self) -> Optional[int]:
        """The smallest window of any sliding-window layer, None if there is none."""
        return min((w for w in self.windows if w), default=None)


def text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a transformers causal LM with a .config, got {type(model).__name__}")
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_supported(model: nn.Module) -> ModelLimits:
    """Raise UnsupportedModelError for variants that need more than causal attention over kept keys."""
    config = text_config(model)
    name = f"{type(model).__name__} (model_type={getattr(config, 'model_type', '?')!r})"
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name}: an encoder-decoder model (cross-attention over a bidirectional "
                                    f"encoder); {ACCEPTED}")
    check_causal_lm(model, name)
    if getattr(config, "model_type", None) in _ALIBI_MODEL_TYPES or getattr(config, "alibi", False):
        raise UnsupportedModelError(f"{name}: ALiBi position bias is not supported (only rotary or learned "
                                    "absolute positions)")
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        raise UnsupportedModelError(f"{name}: config has no num_hidden_layers")
    softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
    return ModelLimits(layers, getattr(config, "max_position_embeddings", None), layer_windows(config, name),
                       softcap)


def check_causal_lm(model: nn.Module, name: str) -> None:
    """Refuse a model that is not a causal LM with a head, by running it on a few tokens (the config cannot say:
    ``is_decoder`` is False on causal GPT-NeoX configs, and absent on most): a base model returns no
    ``logits``; a model whose logits at earlier positions change with the last token attends bidirectionally
    (BertForMaskedLM, BertLMHeadModel with ``is_decoder=False``), which a KV cache cannot serve. A model that
    cannot run this way (a forward with other inputs) is left to the capture, which says what it needs."""
    params = next(iter(model.parameters()), None)
    if params is None or params.device.type == "meta":
        return
    vocab = int(getattr(text_config(model), "vocab_size", 0) or 0)
    if vocab < 2:
        return
    ids = (torch.arange(1, _PROBE_TOKENS + 1, device=params.device) % vocab)[None]   # [1, T]
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    model.eval()  # dropout would look like a dependence on later tokens (the capture sets eval() too)
    try:
        # With the attention the capture traces (sdpa / eager): a paged or flash implementation set on the
        # model serves other callers (paged attention without its cache is not causal); the capture warns.
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            with attention_implementation(model):
                out, out_changed = (model(input_ids=x, use_cache=False) for x in (ids, changed))
    except Exception:  # noqa: BLE001 - not callable like a causal LM: the capture reports what is missing
        return
    logits = getattr(out, "logits", None)
    if logits is None:
        kind = type(out).__name__
        raise UnsupportedModelError(f"{name}: returns {kind} without logits (a base model without an LM head?); "
                                    f"{ACCEPTED}")
    earlier, earlier_changed = logits[:, :-1].float(), out_changed.logits[:, :-1].float()
    scale = float(earlier.abs().max()) or 1.0
    if float((earlier - earlier_changed).abs().max()) > 1e-3 * scale:
        hint = (" (its config says is_decoder=False)" if getattr(model.config, "is_decoder", None) is False
                else "")
        raise UnsupportedModelError(f"{name}: its attention is bidirectional{hint}: the logits of earlier tokens "
                                    f"change with a later token, so there is no KV cache to evict from; {ACCEPTED}")


def layer_windows(config, name: str = "model") -> tuple[int, ...]:
    """Per layer, the sliding window W from the config (``layer_types`` + ``sliding_window``), 0 for full
    attention. Without ``layer_types``, a ``sliding_window`` (unless ``use_sliding_window`` is False) applies
    to every layer, as in Mistral."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (int(window),) * layers if window else (0,) * layers
    if len(layer_types) != layers:
        raise UnsupportedModelError(f"{name}: config.layer_types has {len(layer_types)} entries for {layers} "
                                    "layers")
    windows = []
    for i, kind in enumerate(layer_types):
        if kind in _SLIDING_KINDS:
            if not window:
                raise UnsupportedModelError(f"{name}: layer {i} is {kind!r} but config.sliding_window is {window}")
            windows.append(int(window))
        elif kind in _FULL_KINDS:
            windows.append(0)
        else:
            allowed = ", ".join(map(repr, _FULL_KINDS + _SLIDING_KINDS))
            raise UnsupportedModelError(f"{name}: layer {i} has attention kind {kind!r}; supported: {allowed}")
    return tuple(windows)


def check_sequence_fits(limits: ModelLimits, max_seq_len: int) -> None:
    """A sequence longer than the positions the model knows is an error (sliding-window layers serve any
    length: they keep a window cache)."""
    if limits.max_positions is not None and max_seq_len > limits.max_positions:
        raise ValueError(f"sequence of {max_seq_len} tokens (prompt + max_new_tokens) exceeds the model's "
                         f"max_position_embeddings={limits.max_positions}")


def check_rolling_fits(limits: ModelLimits, max_slots: int, before: int, block: int, context: str = "") -> None:
    """With rolling positions a block of ``block`` tokens after ``before`` others sees at most
    min(max_slots, before) held keys, then itself: its largest rotary position must be one the model knows.
    ``context`` starts the error message (what the caller was asked for)."""
    held = min(max_slots, before)
    if limits.max_positions is not None and held + block > limits.max_positions:
        raise ValueError(f"{context}rolling positions reach {held} held keys + a block of {block} = "
                         f"{held + block}, beyond the model's max_position_embeddings={limits.max_positions}: use "
                         "fewer slots or a smaller block (prefill=c)")


def check_capped_fits(limits: ModelLimits, block: int, context: str = "") -> None:
    """With capped distances (kernels/rolling.py) a block of ``block`` tokens reaches rotary position
    max(D, block - 1), D already checked by H2OConfig.position_cap: the block itself must fit the model."""
    if limits.max_positions is not None and block > limits.max_positions:
        raise ValueError(f"{context}a block of {block} tokens spans distances beyond the model's "
                         f"max_position_embeddings={limits.max_positions}: use a smaller block (prefill=c)")


_ATTN_IMPLS = ("sdpa", "eager")


@contextlib.contextmanager
def attention_implementation(model: nn.Module):
    """Run the model with SDPA (or eager, when it supports only that) for the capture, then restore the
    user's choice: the model object is left as it was given."""
    config = model.config
    before = getattr(config, "_attn_implementation", None)
    if before in _ATTN_IMPLS:
        yield before
        return
    try:
        model.set_attn_implementation("sdpa")
        chosen = "sdpa"
    except (ValueError, ImportError, AttributeError):
        model.set_attn_implementation("eager")
        chosen = "eager"
    if before is not None:
        # H2O replaces the attention anyway; say which implementation the captured graph was traced with.
        warnings.warn(f"attn_implementation={before!r} cannot be captured; the H2O graph is traced with "
                      f"{chosen!r} attention (the model itself keeps {before!r})", stacklevel=3)
    try:
        yield chosen
    finally:
        if before is not None:
            with contextlib.suppress(ValueError, ImportError, AttributeError):
                model.set_attn_implementation(before)
