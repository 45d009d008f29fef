"""Which models the attention pass can serve, decided from the config before anything is traced."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

# Position biases added to the attention logits: the bias of an evicted key depends on distances the cache
# no longer keeps consistent, and these models carry it in an additive mask we would drop.
_ALIBI_MODEL_TYPES = ("bloom", "mpt", "falcon_alibi")


class UnsupportedModelError(ValueError):
    """The model has an attention variant the H2O pass cannot serve; the message names it."""


@dataclass(frozen=True)
class ModelLimits:
    num_layers: int
    max_positions: Optional[int]
    sliding_window: Optional[int]  # smallest window of any sliding-window layer, None if none


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
        raise UnsupportedModelError(f"{name}: encoder-decoder models use cross-attention; only decoder-only "
                                    "causal LMs are supported")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        raise UnsupportedModelError(f"{name}: attention logit soft-capping (attn_logit_softcapping={softcap}) is "
                                    "not supported")
    if getattr(config, "model_type", None) in _ALIBI_MODEL_TYPES or getattr(config, "alibi", False):
        raise UnsupportedModelError(f"{name}: ALiBi position bias is not supported (only rotary or learned "
                                    "absolute positions)")
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        raise UnsupportedModelError(f"{name}: config has no num_hidden_layers")
    return ModelLimits(layers, getattr(config, "max_position_embeddings", None), _sliding_window(config))


def _sliding_window(config) -> Optional[int]:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and not any("sliding" in str(kind) for kind in layer_types):
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def check_sequence_fits(limits: ModelLimits, max_seq_len: int) -> None:
    """A sequence longer than the positions the model knows, or than a sliding window, is an error."""
    if limits.max_positions is not None and max_seq_len > limits.max_positions:
        raise ValueError(f"sequence of {max_seq_len} tokens (prompt + max_new_tokens) exceeds the model's "
                         f"max_position_embeddings={limits.max_positions}")
    if limits.sliding_window is not None and max_seq_len > limits.sliding_window:
        raise UnsupportedModelError(
            f"sequence of {max_seq_len} tokens exceeds the model's sliding window ({limits.sliding_window}); "
            "sliding-window layers are served only while the whole sequence fits in the window")
