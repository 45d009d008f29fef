"""The tiny model's architecture: a small grouped-query-attention Llama config sized for the fp16 budget."""

from __future__ import annotations

import math

# The package ships the weights; keep the fp16 file under this many bytes (the "<= 15 MB").
FP16_BUDGET_BYTES = 15_000_000


def llama_param_count(cfg) -> int:
    """Exact parameter count of ``LlamaForCausalLM(cfg)`` without building it (no biases, RMSNorm weights)."""
    h, v, i = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    hd = cfg.head_dim or h // cfg.num_attention_heads
    attn = h * cfg.num_attention_heads * hd * 2 + h * cfg.num_key_value_heads * hd * 2  # q, o + k, v
    layer = attn + 3 * h * i + 2 * h
    lm_head = 0 if cfg.tie_word_embeddings else v * h
    return v * h + cfg.num_hidden_layers * layer + h + lm_head


def build_llama_config(
    vocab_size: int,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
    *,
    num_layers: int = 6,
    hidden_size: int = 256,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool | None = None,
    max_fp16_bytes: int = FP16_BUDGET_BYTES,
):
    """A small Llama config with grouped-query attention (``num_kv_heads`` < ``num_heads``).

    ``intermediate_size`` defaults to 8/3 x hidden rounded up to a multiple of 8 (SwiGLU's usual ratio).
    ``tie_word_embeddings=None`` unties the output head unless the untied model would exceed
    ``max_fp16_bytes`` in fp16; with the defaults (vocab 8192) the untied model is ~16.7 MB, so it ties.
    """
    from transformers import LlamaConfig

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if min(num_layers, hidden_size, vocab_size, max_position_embeddings) <= 0:
        raise ValueError("num_layers, hidden_size, vocab_size and max_position_embeddings must be positive")
    if intermediate_size is None:
        intermediate_size = math.ceil(8 * hidden_size / 3 / 8) * 8

    def make(tie: bool):
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
            rms_norm_eps=1e-5,
            initializer_range=0.02,
            tie_word_embeddings=tie,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )

    if tie_word_embeddings is None:
        tie_word_embeddings = 2 * llama_param_count(make(False)) > max_fp16_bytes
    return make(bool(tie_word_embeddings))
