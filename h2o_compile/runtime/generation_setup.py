"""From generate()'s arguments to transformers' GenerationConfig, LogitsProcessorList and StoppingCriteriaList.

Every rule here follows transformers' own ``GenerationMixin.generate`` (generation/utils.py of the installed
version), so that ``H2OModel.generate`` and ``model.generate`` read the same arguments the same way:

* the config: a copy of ``generation_config`` (or an empty one), filled from the model's generation_config,
  then transformers' global defaults (``top_k=50`` when sampling, ``max_length=20``, ...), then updated by
  the keyword arguments; ``GenerationConfig.update`` validates it as transformers does;
* the processors and stopping criteria: transformers' public classes, built in the order its
  ``_get_logits_processor`` / ``_get_stopping_criteria`` build them, the user's lists merged in the same way;
* what the H2O loop does not serve (beam search, assisted decoding, guidance, attentions / hidden states as
  outputs, ...): a ValueError naming the argument, never a silent fallback.
"""

from __future__ import annotations

import copy
import warnings
from typing import Optional

import torch
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers import generation as hf
from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

# generate() arguments of transformers that name something the H2O loop does not do: accepted only when None
# (or False), so a drop-in call that spells out the default still works.
_GENERATE_ONLY = ("prefix_allowed_tokens_fn", "synced_gpus", "assistant_model", "negative_prompt_ids",
                  "negative_prompt_attention_mask", "custom_generate", "assistant_tokenizer", "trust_remote_code")

# (attribute, the values it may take, why it is refused otherwise). ``None`` always passes: unset.
_REFUSED = (
    ("num_beams", (1,), "beam search is not served (one H2O cache per returned row; use do_sample or greedy)"),
    ("num_beam_groups", (1,), "group beam search is not served"),
    ("diversity_penalty", (0.0,), "group beam search is not served"),
    ("constraints", (), "constrained beam search is not served"),
    ("force_words_ids", (), "constrained beam search is not served"),
    ("penalty_alpha", (0.0,), "contrastive search is not served"),
    ("dola_layers", (), "DoLa decoding is not served"),
    ("low_memory", (False,), "it belongs to contrastive search, which is not served"),
    ("use_mtp", (False,), "assisted (multi-token) decoding is not served"),
    ("is_assistant", (False,), "assisted decoding is not served"),
    ("prompt_lookup_num_tokens", (), "prompt-lookup (assisted) decoding is not served"),
    ("assistant_early_exit", (), "assisted decoding is not served"),
    ("guidance_scale", (1.0,), "classifier-free guidance needs a second, unconditional cache; not served"),
    ("encoder_repetition_penalty", (1.0,), "an encoder-decoder option; not served"),
    ("encoder_no_repeat_ngram_size", (0,), "an encoder-decoder option; not served"),
    ("output_attentions", (False,), "the H2O graph returns logits only"),
    ("output_hidden_states", (False,), "the H2O graph returns logits only"),
    ("watermarking_config", (), "watermarking is not served"),
    ("token_healing", (False,), "token healing is not served"),
    ("compile_config", (), "the decode step compiles as optimize(compile=...) says"),
    ("prefill_chunk_size", (), "the prompt is chunked as optimize(prefill=...) says"),
    ("continuous_batching_config", (), "continuous batching is not served"),
    # Other cache settings choose among transformers' caches, which the H2O cache replaces: they are moot.
    ("cache_implementation", tuple(ALL_CACHE_IMPLEMENTATIONS), "'paged' is continuous batching, not served"),
)


def prepare_config(defaults: Optional[GenerationConfig], generation_config: Optional[GenerationConfig],
                   kwargs: dict) -> tuple[GenerationConfig, dict]:
    """The generation config of one call, and extras: ``tokenizer`` (for stop_strings) and
    ``default_max_length`` (max_length came from nowhere but the global default; transformers then counts it
    from the prompt's end, and warns).

    Priority as in transformers: kwargs > ``generation_config`` > the model's ``defaults`` > global defaults.
    """
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(f"generation_config must be a transformers.GenerationConfig, got "
                         f"{type(generation_config).__name__}")
    kwargs = dict(kwargs)
    extras = {"tokenizer": kwargs.pop("tokenizer", None)}
    for name in _GENERATE_ONLY:
        value = kwargs.pop(name, None)
        if value is not None and value is not False:
            raise ValueError(f"{name} is not served by H2O generate (greedy and sampling only); leave it None")
    defaults = defaults if defaults is not None else GenerationConfig()

    extras["default_max_length"] = (kwargs.get("max_length") is None and defaults.max_length is None
                                    and (generation_config is None or generation_config.max_length is None))
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    config.update(**defaults.to_dict(), defaults_only=True, allow_custom_entries=True)
    # A private staticmethod, but the one source of transformers' defaults (top_k=50, max_length=20, ...):
    # copying its values here would drift from the installed version.
    config.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    unused = config.update(**kwargs)
    if unused:
        raise ValueError(f"generate() got arguments it does not serve: {', '.join(sorted(unused))} (neither "
                         "GenerationConfig fields nor tokenizer; the H2O graph takes no other model inputs)")
    check_served(config)
    return config, extras


def check_served(config: GenerationConfig) -> None:
    """ValueError naming the first setting of ``config`` that the H2O loop (greedy / sampling) does not serve."""
    for name, allowed, why in _REFUSED:
        value = getattr(config, name, None)
        if value is not None and value not in allowed:
            raise ValueError(f"{name}={value!r} is not supported by H2O generate: {why}")
    mode = config.get_generation_mode()
    if mode not in (hf.GenerationMode.GREEDY_SEARCH, hf.GenerationMode.SAMPLE):
        raise ValueError(f"generation mode {mode.value!r} is not supported by H2O generate (greedy and sampling)")


def special_tokens(config: GenerationConfig, device) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(eos [E] int64 or None, pad [] int64 or None) as transformers prepares them: pad falls back to eos[0]."""
    eos = None if config.eos_token_id is None else torch.as_tensor(config.eos_token_id, dtype=torch.long,
                                                                    device=device).reshape(-1)
    pad = None if config.pad_token_id is None else torch.as_tensor(config.pad_token_id, dtype=torch.long,
                                                                    device=device)
    if pad is None and eos is not None:
        if not eos.numel():  # eos_token_id=[]: never stop on EOS (transformers would fail taking eos[0])
            return None, None
        pad = eos[0]
    return eos, pad


def infer_mask(input_ids: Tensor, eos: Optional[Tensor], pad: Optional[Tensor]) -> Optional[Tensor]:
    """transformers' mask for a prompt given without one: pad tokens are padding, unless pad is also an EOS
    (then it cannot tell) -> [B, P] bool, or None (no padding)."""
    if pad is None or not bool(torch.isin(input_ids, pad).any()):
        return None
    if eos is not None and bool(torch.isin(eos, pad).any()):
        return None
    return input_ids.ne(pad)


def lengths(config: GenerationConfig, extras: dict, prompt_len: int, max_positions: Optional[int]) -> None:
    """Set ``config.max_length`` / ``min_length`` for a prompt of ``prompt_len`` tokens and check them, as
    transformers' _prepare_generated_length and _validate_generated_length do."""
    if config.max_new_tokens is not None:
        config.max_length = config.max_new_tokens + prompt_len
    elif extras["default_max_length"]:  # the global default: 20 new tokens, within the model's positions
        config.max_length = config.max_length + prompt_len
        if max_positions is not None:
            config.max_length = min(config.max_length, max_positions)
        warnings.warn(f"Using the model-agnostic default `max_length` (={config.max_length}) to control the "
                      "generation length. We recommend setting `max_new_tokens` to control the maximum length of "
                      "the generation.", UserWarning, stacklevel=4)
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + prompt_len
    if prompt_len >= config.max_length:
        raise ValueError(f"Input length of input_ids is {prompt_len}, but `max_length` is set to "
                         f"{config.max_length}: increase max_length or, better, set max_new_tokens")
    if config.min_length is not None and config.min_length > config.max_length:
        warnings.warn(f"Unfeasible length constraints: min_length ({config.min_length}) is larger than the "
                      f"maximum possible length ({config.max_length}).", UserWarning, stacklevel=4)


def merge(default, custom):
    """transformers' rule for a user's list: an entry of the same type replaces the default one, the rest are
    appended."""
    if not custom:
        return default
    merged = type(default)(next((c for c in custom if type(c) is type(d)), d) for d in default)
    merged.extend(c for c in custom if c not in merged)
    return merged


def logits_processors(config: GenerationConfig, prompt_len: int, mask: Optional[Tensor], eos: Optional[Tensor],
                      device, custom=None) -> LogitsProcessorList:
    """transformers' processors for ``config``, in the order its generate applies them; the user's ``custom``
    list is merged before the sampling warpers, as there.

    Args:
        prompt_len: P; mask: [B, P] bool of the (expanded) prompt, None when nothing is padding.
    """
    procs = LogitsProcessorList()
    if config.sequence_bias is not None:
        procs.append(hf.SequenceBiasLogitsProcessor(sequence_bias=config.sequence_bias))
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        ignore = mask.int().argmax(dim=1) if mask is not None else None  # the left padding is no prompt token
        procs.append(hf.RepetitionPenaltyLogitsProcessor(config.repetition_penalty, prompt_ignore_length=ignore))
    if config.no_repeat_ngram_size is not None and config.no_repeat_ngram_size > 0:
        procs.append(hf.NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        procs.append(hf.NoBadWordsLogitsProcessor(config.bad_words_ids, eos))
    if config.min_length is not None and eos is not None and config.min_length > 0:
        procs.append(hf.MinLengthLogitsProcessor(config.min_length, eos, device=device))
    if config.min_new_tokens is not None and eos is not None and config.min_new_tokens > 0:
        procs.append(hf.MinNewTokensLengthLogitsProcessor(prompt_len, config.min_new_tokens, eos, device=device))
    if config.forced_bos_token_id is not None:
        procs.append(hf.ForcedBOSTokenLogitsProcessor(config.forced_bos_token_id))
    if config.forced_eos_token_id is not None:
        procs.append(hf.ForcedEOSTokenLogitsProcessor(config.max_length, config.forced_eos_token_id, device=device))
    if config.remove_invalid_values is True:
        procs.append(hf.InfNanRemoveLogitsProcessor())
    if config.exponential_decay_length_penalty is not None:
        procs.append(hf.ExponentialDecayLengthPenalty(config.exponential_decay_length_penalty, eos, prompt_len))
    if config.suppress_tokens is not None:
        procs.append(hf.SuppressTokensLogitsProcessor(config.suppress_tokens, device=device))
    if config.begin_suppress_tokens is not None:
        begin = prompt_len if prompt_len > 1 or config.forced_bos_token_id is None else prompt_len + 1
        procs.append(hf.SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin, device=device))
    procs = merge(procs, custom)
    if config.do_sample:  # the warpers; one row per sequence, so one token to keep (beam search would keep more)
        if config.temperature is not None and config.temperature != 1.0:
            procs.append(hf.TemperatureLogitsWarper(config.temperature))
        if config.top_h is not None:
            procs.append(hf.TopHLogitsWarper(top_h=config.top_h))
        if config.top_k is not None and config.top_k != 0:
            procs.append(hf.TopKLogitsWarper(top_k=config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            procs.append(hf.TopPLogitsWarper(top_p=config.top_p))
        if config.min_p is not None:
            procs.append(hf.MinPLogitsWarper(min_p=config.min_p))
        if config.typical_p is not None and config.typical_p < 1.0:
            procs.append(hf.TypicalLogitsWarper(mass=config.typical_p))
        if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
            procs.append(hf.EpsilonLogitsWarper(epsilon=config.epsilon_cutoff))
        if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
            procs.append(hf.EtaLogitsWarper(epsilon=config.eta_cutoff, device=device))
    if config.renormalize_logits is True:  # always last, as in transformers
        procs.append(hf.LogitNormalization())
    return procs


def stopping_criteria(config: GenerationConfig, eos: Optional[Tensor], tokenizer, max_positions: Optional[int],
                      custom=None) -> StoppingCriteriaList:
    """transformers' criteria: max_length, max_time, stop_strings (with ``tokenizer``), EOS; then ``custom``."""
    criteria = StoppingCriteriaList()
    if config.max_length is not None:
        criteria.append(hf.MaxLengthCriteria(max_length=config.max_length, max_position_embeddings=max_positions))
    if config.max_time is not None:
        criteria.append(hf.MaxTimeCriteria(max_time=config.max_time))
    if config.stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings needs the model's tokenizer: pass generate(..., tokenizer=tokenizer)")
        criteria.append(hf.StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer))
    if eos is not None:
        criteria.append(hf.EosTokenCriteria(eos_token_id=eos))
    return merge(criteria, custom)
