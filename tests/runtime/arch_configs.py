"""Small random-weight configs of the architectures the pass is tested on (no hub access)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 96

# name -> (config class, model class, kwargs). Large initializer ranges make the random logits peaky, so
# greedy decoding does not hinge on float noise between two equal implementations.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=64, intermediate_size=96, num_attention_heads=8,
                                                      num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(hidden_size=64, intermediate_size=96,
                                                            num_attention_heads=4, num_key_value_heads=2,
                                                            sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                      num_key_value_heads=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                      num_key_value_heads=2, head_dim=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                   num_key_value_heads=2, pad_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(hidden_size=64, intermediate_size=96,
                                                             num_attention_heads=4, rotary_pct=0.5)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(hidden_size=64, ffn_dim=96, num_attention_heads=4,
                                                word_embed_proj_dim=64, pad_token_id=0)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_head=4, n_positions=128)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                      num_key_value_heads=1, head_dim=16)),
}


WINDOW = 16

# Families with per-layer attention kinds: sliding-window layers (window 16, so tests run several windows
# long), Gemma 2's logit soft-capping, GPT-OSS's learned attention sinks. Three layers: sliding, full, sliding.
HYBRID_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
HYBRID = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=WINDOW, layer_types=HYBRID_LAYERS, query_pre_attn_scalar=24, rope_local_base_freq=100.0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=WINDOW, layer_types=HYBRID_LAYERS, attn_logit_softcapping=1.5)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=WINDOW, layer_types=HYBRID_LAYERS, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def build(name: str, *, layers: int = 2, seed: int = 0, dtype=torch.float32, init: float = 0.25):
    config_cls, model_cls, kwargs = {**ARCHITECTURES, **HYBRID}[name]
    if name in HYBRID:
        layers = len(HYBRID_LAYERS)
    config = getattr(transformers, config_cls)(vocab_size=VOCAB, num_hidden_layers=layers,
                                               max_position_embeddings=128, initializer_range=init, **kwargs)
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).to(dtype).eval()
