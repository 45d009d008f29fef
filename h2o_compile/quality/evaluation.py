"""Quality of an H2O cache: streaming perplexity and greedy-generation agreement, per policy and budget.

This reproduces the paper's accuracy-vs-budget figure on a held-out text: each sequence is fed as a short
prompt block and then one token per step (teacher forcing through ``H2OModel.step``), so every prediction
after the prompt is made from the compressed cache, exactly as during generation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from ..config import H2OConfig, parse_options
from ..kernels.quantized import check_kv_dtype
from ..runtime.model import optimize


@dataclass
class EvalSettings:
    budgets: Sequence[float] = (0.05, 0.1, 0.2, 0.5, 1.0)
    policies: Sequence[str] = ("full", "h2o", "local", "sink", "random")
    seq_len: int = 1024
    num_seqs: int = 8             # 0: generation agreement only (long prompts, no perplexity sweep)
    batch_size: int = 8
    prompt_len: int = 32          # perplexity is measured on the tokens after this prompt block
    gen_prompt_len: int = 896     # + gen_new_tokens = seq_len and gen_prompts = batch_size: one compile serves both
    gen_new_tokens: int = 128
    gen_prompts: int = 8
    compile: object = True
    compress_sliding: bool = False  # sliding-window layers under the budget too (H2OConfig.compress_sliding)
    h2o_sinks: int = 0              # > 0: also h2o with that many sink tokens, reported as "h2o+<n>sinks"
    h2o_rules: Sequence[str] = ()   # also h2o under these score rules (presets.parse_options), "h2o[<rule>]"
    kv_dtypes: Sequence[str] = ("model",)  # every configuration once per entry dtype; int8 rows are "<label>+int8"

    def __post_init__(self) -> None:
        if not self.budgets or any(not (0 < b <= 1) for b in self.budgets):
            raise ValueError(f"budgets={list(self.budgets)} must be fractions in (0, 1]")
        if not 1 <= self.prompt_len < self.seq_len:
            raise ValueError(f"prompt_len={self.prompt_len} must be in [1, seq_len={self.seq_len})")
        if not self.policies and not self.h2o_sinks and not self.h2o_rules:
            raise ValueError("no configuration to run: give at least one policy, h2o_sinks > 0 or an h2o rule")
        for rule in self.h2o_rules:  # a ValueError names a bad rule before the sweep starts
            H2OConfig.from_options(dict(compress_sliding=self.compress_sliding, **_rule_options(rule)))
        for kv_dtype in self.kv_dtypes:
            check_kv_dtype(kv_dtype)
        if self.num_seqs < 0:
            raise ValueError(f"num_seqs={self.num_seqs} must be >= 0 (0: generation agreement only)")
        for name in ("batch_size", "gen_new_tokens", "gen_prompts", "gen_prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


@dataclass
class EvalResult:
    settings: dict
    perplexity: dict = field(default_factory=dict)     # policy -> {budget: ppl}
    agreement: dict = field(default_factory=dict)      # policy -> {budget: {"rouge_l": .., "prefix": ..}}
    kv_bytes: dict = field(default_factory=dict)       # policy -> {budget: H2O state bytes per sequence}
    reference_bytes: dict = field(default_factory=dict)  # per sequence of "tokens": "full" (every token, every
    #                                                      layer) and "transformers" (DynamicCache(config=...))


def read_tail(path, fraction: float = 0.1) -> str:
    """The last ``fraction`` of a text file (the held-out part the shipped model never trained on)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1]")
    text = Path(path).read_text(encoding="utf-8")
    return text[len(text) - int(len(text) * fraction):]


def token_windows(tokenizer, texts: Sequence[str], seq_len: int, count: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len`` tokens, spread evenly over the texts: LongTensor [N, seq_len]."""
    windows = []
    for text in texts:
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        usable = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
        windows.append(usable)
    pool = torch.cat(windows) if windows else torch.empty(0, seq_len, dtype=torch.long)
    if len(pool) < count:
        raise ValueError(f"the text holds only {len(pool)} windows of {seq_len} tokens, {count} requested")
    pick = torch.linspace(0, len(pool) - 1, count).round().long()
    return pool[pick]


@torch.no_grad()
def streaming_nll(h2o_model, ids: torch.Tensor, prompt_len: int) -> tuple[float, int]:
    """Sum of NLL over tokens prompt_len..L-1 of ids [B, L], fed as a prompt block then token by token."""
    batch, length = ids.shape
    h2o_model.reset(batch, length)
    logits = h2o_model.step(ids[:, :prompt_len])[:, -1]
    total = 0.0
    for t in range(prompt_len, length):
        total += torch.nn.functional.cross_entropy(logits.float(), ids[:, t], reduction="sum").item()
        if t + 1 < length:
            logits = h2o_model.step(ids[:, t:t + 1])[:, -1]
    return total, batch * (length - prompt_len)


def rouge_l(candidate: Sequence[int], reference: Sequence[int]) -> float:
    """ROUGE-L F1 between two token sequences (longest common subsequence)."""
    if not candidate or not reference:
        return 0.0
    prev = [0] * (len(reference) + 1)
    for a in candidate:
        cur = [0]
        for j, b in enumerate(reference):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


_SWEPT = ("budget", "policy", "sink_tokens", "compress_sliding")  # set by the sweep's own settings


def _rule_options(rule: str) -> dict:
    """An h2o rule's options; ValueError when it sets what the sweep sets (a calibrated config's rule string
    carries its budget)."""
    options = parse_options(rule)
    swept = [name for name in _SWEPT if name in options]
    if swept:
        raise ValueError(f"h2o rule {rule!r} sets {', '.join(swept)}, which the sweep sets itself (--budgets, "
                         "--policies, --sink-tokens, --compress-sliding): drop it from the rule")
    return options


def _configs(settings: EvalSettings):
    """(label, policy, sink_tokens, budget, score-rule kwargs) for every configuration the sweep runs."""
    variants = [(policy, policy, None if policy in ("sink", "full") else 0, {}) for policy in settings.policies]
    if settings.h2o_sinks:
        variants.append((f"h2o+{settings.h2o_sinks}sinks", "h2o", settings.h2o_sinks, {}))
    variants += [(f"h2o[{rule}]", "h2o", 0, _rule_options(rule)) for rule in settings.h2o_rules]
    for kv_dtype in settings.kv_dtypes:
        for label, policy, sinks, rule in variants:
            if kv_dtype != "model":
                label, rule = f"{label}+{kv_dtype}", {**rule, "kv_dtype": kv_dtype}
            for budget in ([1.0] if policy == "full" else settings.budgets):
                yield label, policy, sinks, budget, rule


def evaluate(model, tokenizer, texts: Sequence[str], settings: Optional[EvalSettings] = None,
             progress: bool = True, on_config=None) -> EvalResult:
    """Perplexity and generation agreement for every (policy, budget) in ``settings``.

    ``on_config(result)`` is called after each configuration with the results so far (a long sweep writes
    them as it goes). Without ``full`` among the policies, the full-cache generations that agreement is
    measured against are made first (no full-cache perplexity then). With ``num_seqs=0`` only agreement is
    measured, and KV bytes are those of the generation's cache (prompt + new tokens)."""
    settings = settings or EvalSettings()
    seqs = token_windows(tokenizer, texts, settings.seq_len, settings.num_seqs) if settings.num_seqs else None
    gen_len = settings.gen_prompt_len + settings.gen_new_tokens
    gen_source = token_windows(tokenizer, texts, gen_len, settings.gen_prompts)
    prompts = gen_source[:, :settings.gen_prompt_len]
    result = EvalResult(settings=asdict(settings))
    configs = list(_configs(settings))
    reference_tokens = None
    if configs and configs[0][1] != "full":
        reference_tokens = _generations(optimize(model, budget=1.0, policy="full", compile=settings.compile),
                                        prompts, settings)
    bar = tqdm(configs, desc="eval", disable=not progress)
    for label, policy, sink, budget, rule in bar:
        bar.set_postfix_str(f"{label} @ {budget}")
        h2o = optimize(model, budget=budget, policy=policy, sink_tokens=sink, compile=settings.compile,
                       compress_sliding=settings.compress_sliding, **rule)
        if seqs is not None:
            nll, count = 0.0, 0
            for start in range(0, len(seqs), settings.batch_size):
                part = seqs[start:start + settings.batch_size]
                part_nll, part_count = streaming_nll(h2o, part, settings.prompt_len)
                nll, count = nll + part_nll, count + part_count
            result.perplexity.setdefault(label, {})[budget] = math.exp(nll / count)
            _record_bytes(result, label, budget, h2o, rows=len(part), tokens=settings.seq_len)
        tokens = _generations(h2o, prompts, settings)
        if seqs is None:
            _record_bytes(result, label, budget, h2o, rows=len(prompts), tokens=gen_len)
        if reference_tokens is None:  # the first configuration is the full cache
            reference_tokens = tokens
        scores = [rouge_l(c, r) for c, r in zip(tokens, reference_tokens)]
        prefixes = [common_prefix(c, r) for c, r in zip(tokens, reference_tokens)]
        result.agreement.setdefault(label, {})[budget] = {"rouge_l": sum(scores) / len(scores),
                                                            "prefix": sum(prefixes) / len(prefixes)}
        if on_config is not None:
            on_config(result)
    return result


def _record_bytes(result: EvalResult, label: str, budget: float, h2o, rows: int, tokens: int) -> None:
    """The H2O state per sequence of the cache just used (sized for ``tokens``), and the reference caches."""
    result.kv_bytes.setdefault(label, {})[budget] = h2o.kv_cache_bytes() // rows
    result.reference_bytes = {"tokens": tokens, "full": h2o.full_cache_bytes(1, tokens),
                              "transformers": h2o.hf_cache_bytes(1, tokens),
                              "sliding_layers": sum(window > 0 for window in h2o.limits.windows)}


def _generations(h2o, prompts, settings: EvalSettings) -> list[list[int]]:
    """Greedy continuations of ``prompts`` [N, P] (EOS ignored), as token lists."""
    return h2o.generate(prompts, max_new_tokens=settings.gen_new_tokens, do_sample=False, eos_token_id=[],
                        pad_token_id=0)[:, settings.gen_prompt_len:].tolist()
