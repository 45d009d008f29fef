"""H2OConfig: what to keep in the KV cache, validated once at construction; ScoreRule, the eviction key of
policy ``h2o`` nested in it. ``H2OConfig.parse`` reads the one string syntax (config/rule_string.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from ..kernels.quantized import check_kv_dtype
from ..kernels.rules import SCORES, EvictionRule
from .capabilities import served_by
from .rule_string import PRESET_OPTIONS, format_options, read_options

POSITIONS = ("true", "rolling", "capped")
POLICIES = ("h2o", "local", "sink", "random", "full")
ALLOCATIONS = ("uniform", "prompt", "prompt-heads")  # or a tuple of per-layer shares (runtime/allocation.py)
CONFIG_VERSION = 1  # of to_dict(): from_dict() reads this version

# StreamingLLM keeps four "attention sink" tokens; the `sink` policy uses that unless told otherwise.
DEFAULT_SINK_POLICY_SINKS = 4


def _is_int(value, least: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


@dataclass(frozen=True)
class ScoreRule:
    """The eviction key of policy ``h2o`` (kernels/rules.py registers the scores; ../docs/design.md states them).

    Args:
        score: a registered score: ``"sum"`` (the paper: accumulated attention), ``"mean"`` (accumulated
            attention / (newest position - p + 1)), ``"max"`` (the largest attention one query gave the key,
            summed over its KV group's heads), ``"knorm"`` (query-free: keys with the smallest L2 norm stay).
        decay: g in [0, 1]; a block of T queries updates A = g^T A + sum_t g^(t1 - t) mass_t (with ``"max"``:
            A = max(g^T A, max_t g^(t1 - t) mass_t)). 1 = the paper, 0 = the newest query only (TOVA).
        prompt_window: None, or w >= 1: only the prompt's last w queries add to the scores (SnapKV's
            observation window); later queries add as usual. The prompt is the first block after ``reset``.
        prompt_pool: odd k >= 1: once the prompt is in, its keys' scores are averaged over k neighbouring
            prompt positions (SnapKV's pooling); needs ``prefill="full"``.
        sliding_score: None (every layer evicts by ``score``), or the score of the sliding-window layers when
            ``compress_sliding`` puts them under the policy; ``score`` is then the full-attention layers' own.
            Decay, prompt window and pooling are shared.
    """

    score: str = "sum"
    decay: float = 1.0
    prompt_window: Optional[int] = None
    prompt_pool: int = 1
    sliding_score: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("score", "sliding_score"):
            value = getattr(self, name)
            if (value is not None or name == "score") and value not in SCORES:
                hint = f" (did you mean config={value!r}? it is a preset, not a score)" if _is_preset(value) else ""
                none = "None (the layers share score) or " if name == "sliding_score" else ""
                raise ValueError(f"{name}={value!r}{hint}; allowed: {none}{', '.join(map(repr, SCORES))}")
        if self.prompt_window is not None and not _is_int(self.prompt_window, 1):
            raise ValueError(f"prompt_window={self.prompt_window!r} must be None (every prompt query scores) or "
                             "an int >= 1")
        self.eviction_rule("h2o", window=0)  # validates score, decay and pool together
        if self.sliding_score is not None:
            try:
                self.eviction_rule("h2o", window=1)
            except ValueError as exc:
                raise ValueError(f"sliding_score={self.sliding_score!r}: {exc}") from None
        if self.prompt_window is not None and not SCORES[self.score].reads_attention:
            raise ValueError(f"prompt_window={self.prompt_window} chooses which prompt queries add attention; "
                             f"score={self.score!r} reads no attention")

    def eviction_rule(self, policy: str, window: int) -> EvictionRule:
        """The rule a layer's op carries under ``policy`` (``window``: its sliding window, 0 = full attention)."""
        if policy != "h2o":
            return EvictionRule(policy)
        score = self.sliding_score if window > 0 and self.sliding_score is not None else self.score
        return EvictionRule(policy, score, self.decay, self.prompt_pool)


def _is_preset(name) -> bool:
    return name in PRESET_OPTIONS


_RULE_FIELDS = tuple(f.name for f in dataclasses.fields(ScoreRule))


@dataclass
class H2OConfig:
    """How an H2O cache is sized and which tokens it evicts: the one configuration of the library.

    Build one directly, from a preset (``h2o_compile.PRESETS["recommended"]``), or from the rule string
    (``H2OConfig.parse("recommended+budget=0.1")``); ``replace(**options)`` changes fields, a score rule's
    among them (``decay=0.9``); ``to_dict`` / ``from_dict`` serialise it with a version.

    Args:
        budget: float in (0, 1] = fraction of the total sequence (prompt + new tokens) kept per layer and
            KV head; int >= 1 = that many cache slots.
        recent_ratio: fraction of the capacity reserved for the most recent tokens (the paper splits the
            budget evenly between recent tokens and heavy hitters).
        sink_tokens: the first ``sink_tokens`` positions are never evicted. ``None`` means 0, or 4 for the
            ``sink`` policy (StreamingLLM).
        policy: ``h2o`` (evict by ``rule``), ``local`` (oldest first), ``sink`` (sinks, then oldest first),
            ``random`` (seeded), ``full`` (never evict).
        prefill: ``"full"`` processes the prompt as one block (exact prompt outputs; temporary memory
            grows with the prompt) then compresses to the capacity; an int ``c`` feeds the prompt in chunks
            of ``c`` tokens so memory stays at capacity + c.
        seed: seed of the ``random`` policy.
        compress_sliding: sliding-window layers (hybrid models such as Gemma 3) keep a window cache of
            min(W, sequence) slots by default (exactly the keys the model can still see, as transformers'
            own cache does), and the budget applies to full-attention layers. True compresses them too:
            min(C, W) slots, keys that left the window evicted first, then the policy.
        global_share: with ``compress_sliding`` on a hybrid model, how the budget's slots are split between
            the kinds of layer at the same state size: a full-attention layer holds global_share x C slots (at
            most the sequence) and the sliding-window layers share the rest of the uniform split's slots
            equally (each at most its window). The uniform split holds C on every full-attention layer and
            min(C, W) on every sliding one, so while C <= W a sliding layer gets (L - global_share x L_full) /
            L_sliding x C (L layers, L_full of them full-attention); once C > W the sliding layers give up
            part of their window. 1.0 = every layer C (the paper).
        allocation: how the budget's slots are split between layers. ``"uniform"``: C on every layer (the
            paper). ``"prompt"``: each request's prompt chooses the split (its attention read once before the
            cache is sized, runtime/allocation.py): the layers whose attention is spread get more slots,
            the concentrated ones fewer, the total at most the uniform split's. ``"prompt-heads"``: the same
            per KV head (each KV head its own cache, an h2o op of its own). A tuple of one entry per layer:
            the layer's slots as a multiple of C, or a tuple of one such share per KV head of the layer, as
            :func:`h2o_compile.calibrate` measures them once on a calibration text (saved with the config;
            the KV heads of a layer with equal shares share one cache). The split covers the layers the budget
            governs: the sliding-window layers too with ``compress_sliding`` (each at most its window).
        positions: ``"true"`` rotates keys at their text positions (the model's own behaviour);
            ``"rolling"`` caches keys before RoPE and rotates them by their rank in the cache at attention
            time (StreamingLLM), so a stream can run past the model's max_position_embeddings with every
            relative distance below C + block (rotary models only). ``"capped"`` caches keys before RoPE
            too and rotates each at its true distance to the row's newest token, capped at ``max_distance``
            (at the block's valid tokens - 1 if that is more, so a block's own distances stay exact):
            recent keys sit where the model expects them, older ones at that one far distance.
        max_distance: D of ``positions="capped"``: None = half the model's max_position_embeddings; an int in
            [1, max_position_embeddings - 1].
        rule: the :class:`ScoreRule` of policy ``h2o`` (score, decay, prompt window and pooling, the sliding
            layers' own score); the default is the paper's.
        kv_dtype: ``"model"`` keeps kept keys and values in the model's dtype; ``"int8"`` stores each kept
            key and value vector as int8 with one fp32 scale (symmetric absmax, kernels/quantized.py), about a
            quarter of the fp32 state. Scores, positions and eviction are unchanged.
    """

    budget: Union[float, int] = 0.2
    recent_ratio: float = 0.5
    sink_tokens: Optional[int] = None
    policy: str = "h2o"
    prefill: Union[str, int] = "full"
    seed: int = 0
    compress_sliding: bool = False
    global_share: float = 1.0
    allocation: Union[str, tuple[Union[float, tuple[float, ...]], ...]] = "uniform"
    positions: str = "true"
    max_distance: Optional[int] = None
    rule: ScoreRule = field(default_factory=ScoreRule)
    kv_dtype: str = "model"

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)):
            raise TypeError(f"budget must be a float in (0, 1] or an int >= 1, got {self.budget!r}")
        if isinstance(self.budget, float) and not (0.0 < self.budget <= 1.0):
            raise ValueError(
                f"budget={self.budget!r}: a float budget is a fraction of the sequence and must be in (0, 1]; "
                "pass an int for a fixed number of cache slots"
            )
        if isinstance(self.budget, int) and self.budget < 1:
            raise ValueError(f"budget={self.budget!r}: an int budget is a number of cache slots and must be >= 1")
        if self.policy not in POLICIES:
            hint = f" (did you mean config={self.policy!r}? it is a preset)" if _is_preset(self.policy) else ""
            raise ValueError(f"policy={self.policy!r} is not supported{hint}; choose one of {', '.join(POLICIES)}")
        if not isinstance(self.recent_ratio, (int, float)) or not (0.0 <= self.recent_ratio <= 1.0):
            raise ValueError(f"recent_ratio={self.recent_ratio!r} must be a number in [0, 1]")
        if self.sink_tokens is None:
            self.sink_tokens = DEFAULT_SINK_POLICY_SINKS if self.policy == "sink" else 0
        if not _is_int(self.sink_tokens, 0):
            raise ValueError(f"sink_tokens={self.sink_tokens!r} must be an int >= 0")
        if self.policy == "local" and self.sink_tokens:
            raise ValueError(
                f"policy='local' keeps no sinks but sink_tokens={self.sink_tokens}; use policy='sink' instead"
            )
        if self.prefill != "full" and not _is_int(self.prefill, 1):
            raise ValueError(f"prefill={self.prefill!r} must be 'full' or an int chunk size >= 1")
        if not _is_int(self.seed, 0):
            raise ValueError(f"seed={self.seed!r} must be an int >= 0")
        if not isinstance(self.compress_sliding, bool):
            raise ValueError(f"compress_sliding={self.compress_sliding!r} must be True or False")
        self._check_global_share()
        self._check_allocation()
        if self.positions not in POSITIONS:
            raise ValueError(f"positions={self.positions!r}; allowed: {', '.join(map(repr, POSITIONS))}")
        if self.max_distance is not None:
            if not _is_int(self.max_distance, 1):
                raise ValueError(f"max_distance={self.max_distance!r} must be None or an int >= 1")
            if self.positions != "capped":
                raise ValueError(f"max_distance={self.max_distance} caps the distances of positions='capped'; "
                                 f"positions={self.positions!r} has none")
        self._check_rule()
        check_kv_dtype(self.kv_dtype)
        if isinstance(self.budget, int):
            self.check_split(self.budget)

    def _check_rule(self) -> None:
        if not isinstance(self.rule, ScoreRule):
            raise TypeError(f"rule={self.rule!r} must be a ScoreRule (or use H2OConfig.parse / replace with "
                            "score=, decay=, prompt_window=, prompt_pool=, sliding_score=)")
        if self.policy != "h2o" and self.rule != ScoreRule():
            changed = [f"{f}={getattr(self.rule, f)!r}" for f in _RULE_FIELDS
                       if getattr(self.rule, f) != getattr(ScoreRule(), f)]
            raise ValueError(f"{', '.join(changed)}: the score rule is an option of policy='h2o'; "
                             f"policy={self.policy!r} reads no scores")
        if self.rule.sliding_score is not None and not self.compress_sliding:
            raise ValueError(f"sliding_score={self.rule.sliding_score!r} is the score of the sliding-window layers "
                             "that compress_sliding=True puts under the policy; without it they keep their window "
                             "and never choose")
        if self.rule.prompt_pool > 1 and self.prefill != "full":
            raise ValueError(f"prompt_pool={self.rule.prompt_pool} pools the whole prompt's scores, which needs "
                             f"prefill='full'; got prefill={self.prefill!r}")

    # -- building and serialising ---------------------------------------------------------------------------

    @classmethod
    def from_options(cls, options: dict[str, Any], base: Optional["H2OConfig"] = None) -> "H2OConfig":
        """``base`` (default: the paper's config) with flat ``options``: H2OConfig fields and ScoreRule fields
        (score, decay, prompt_window, prompt_pool, sliding_score) side by side. A policy given without
        sink_tokens takes that policy's default sinks; positions given without max_distance drop the old cap."""
        base = cls() if base is None else base
        if "compression_ratio" in options:  # kvpress's name: what is removed, not what is kept
            ratio = options["compression_ratio"]
            hint = f" = {1 - ratio:g}" if isinstance(ratio, (int, float)) and 0 <= ratio < 1 else ""
            raise ValueError(f"compression_ratio={ratio!r} is kvpress's share of the cache to remove; H2O takes the "
                             f"share to keep: budget = 1 - compression_ratio{hint}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"rule"}
        unknown = sorted(set(options) - fields - set(_RULE_FIELDS) - {"rule"})
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(fields))}, "
                            f"{', '.join(_RULE_FIELDS)}")
        top = {k: v for k, v in options.items() if k in fields}
        if "policy" in top and "sink_tokens" not in top:
            top["sink_tokens"] = None
        if "positions" in top and "max_distance" not in top:
            top["max_distance"] = None
        rule = options.get("rule", base.rule)
        rule_options = {k: v for k, v in options.items() if k in _RULE_FIELDS}
        if rule_options:
            rule = dataclasses.replace(rule, **rule_options)
        return dataclasses.replace(base, rule=rule, **top)

    def replace(self, **options) -> "H2OConfig":
        """A copy with ``options`` changed (:meth:`from_options`): ``config.replace(budget=0.1, decay=0.9)``."""
        return type(self).from_options(options, base=self)

    @classmethod
    def parse(cls, text: str) -> "H2OConfig":
        """A config from the rule string: presets, score names and ``name=value`` options joined by ``+``, e.g.
        ``"recommended"``, ``"tova+budget=0.1"``, ``"max+decay=0.99+prompt_window=64"`` (config/rule_string.py)."""
        return cls.from_options(read_options(text, cls))

    def to_string(self) -> str:
        """The rule string of this config (its fields that differ from the defaults): ``parse`` reads it back."""
        return format_options(self)

    def to_dict(self) -> dict[str, Any]:
        """Every field, the rule nested, plus ``version``: what save_pretrained and the ONNX metadata write."""
        return {"version": CONFIG_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "H2OConfig":
        """The config :meth:`to_dict` wrote; ValueError for another version or an unknown field."""
        data = dict(data)
        version = data.pop("version", None)
        if version != CONFIG_VERSION:
            raise ValueError(f"H2OConfig version {version!r}; this library reads version {CONFIG_VERSION}")
        rule = data.pop("rule", {})
        try:
            return cls(rule=ScoreRule(**rule), **data)
        except TypeError as exc:
            raise ValueError(f"not an H2OConfig dict: {exc}") from None

    @property
    def served_by(self) -> list[str]:
        """The backends that serve this config (config/capabilities.py)."""
        return served_by(self)

    def _check_global_share(self) -> None:
        share = self.global_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share < math.inf:
            raise ValueError(f"global_share={share!r} must be a number >= 1 (1 = every layer the same slots)")
        if share < 1.0:
            raise ValueError(f"global_share={share!r} would move slots to the sliding-window layers, which never "
                             "hold more than their window; allowed: >= 1 (1 = every layer the same slots)")
        if share != 1.0 and not self.compress_sliding:
            raise ValueError(f"global_share={share!r} moves slots between full-attention and sliding-window "
                             "layers, which needs both compressed: set compress_sliding=True (sliding-window "
                             "layers otherwise keep their whole window)")
        if share != 1.0 and self.policy == "full":
            raise ValueError(f"global_share={share!r} with policy='full': every layer keeps every token, there "
                             "are no slots to move")

    def _check_allocation(self) -> None:
        value = self.allocation
        if isinstance(value, (list, tuple)):  # lists from JSON
            value = self.allocation = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        if isinstance(value, tuple):
            flat = [v for entry in value for v in (entry if isinstance(entry, tuple) else (entry,))]
            bad = [v for v in flat if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf]
            empty = [entry for entry in value if isinstance(entry, tuple) and not entry]
            if bad or empty or not value:
                raise ValueError(f"allocation={value!r}: a calibrated split is one share > 0 per layer, or per KV head "
                                 "of a layer (its slots as a multiple of C); got " +
                                 (f"{bad[0]!r}" if bad else "an empty layer" if empty else "none"))
            # A layer whose KV heads all have one share is not split: its share alone, so the rule string round-trips.
            self.allocation = tuple(tuple(map(float, entry)) if isinstance(entry, tuple) and len(set(entry)) > 1
                                    else float(entry[0] if isinstance(entry, tuple) else entry) for entry in value)
        elif value not in ALLOCATIONS:
            raise ValueError(f"allocation={value!r}; allowed: {', '.join(map(repr, ALLOCATIONS))} or a tuple of "
                             "per-layer shares (h2o_compile.calibrate)")
        if value != "uniform" and self.global_share != 1.0:
            raise ValueError(f"allocation={value!r} with global_share={self.global_share!r}: both split the slots "
                             "between layers; choose one")
        if value != "uniform" and self.policy == "full":
            raise ValueError(f"allocation={value!r} with policy='full': every layer keeps every token, there are "
                             "no slots to split")

    @property
    def splits_by_prompt(self) -> bool:
        """Whether each request's prompt chooses the split (allocation "prompt" or "prompt-heads")."""
        return self.allocation in ("prompt", "prompt-heads")

    def layer_rules(self, windows: Sequence[int]) -> list[str]:
        """The ``EvictionRule.spec`` of every layer (``windows``: each layer's sliding window, 0 = full
        attention), what the graph's h2o ops carry. ValueError when ``sliding_score`` is given for a model that
        lacks one of the two kinds of layer (it would silently do nothing, or replace ``score`` on every
        layer)."""
        sliding = sum(1 for w in windows if w > 0)
        if self.rule.sliding_score is not None and sliding in (0, len(windows)):
            kind = "no sliding-window layer" if sliding == 0 else "no full-attention layer"
            raise ValueError(f"sliding_score={self.rule.sliding_score!r} sets the sliding-window layers' score "
                             f"apart from the full-attention layers', but this model has {kind}; use score= alone")
        return [self.rule.eviction_rule(self.policy, window).spec for window in windows]

    def position_cap(self, max_positions: Optional[int]) -> int:
        """D the ops cap distances at: ``max_distance`` or half of ``max_positions`` (the model's) with
        ``positions="capped"``, 0 (rank numbering or none) otherwise. ValueError when D is not a distance
        the model knows, or cannot be chosen."""
        if self.positions != "capped":
            return 0
        if self.max_distance is None:
            if max_positions is None or max_positions < 2:
                raise ValueError(f"positions='capped' needs max_distance: the model's config gives "
                                 f"max_position_embeddings={max_positions}, no distance >= 1 to take half of")
            return max_positions // 2
        if max_positions is not None and self.max_distance >= max_positions:
            raise ValueError(f"max_distance={self.max_distance} is beyond the model's positions: allowed "
                             f"1..{max_positions - 1} (max_position_embeddings={max_positions})")
        return self.max_distance

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == "int8"

    @property
    def scores_prompt_specially(self) -> bool:
        """Whether the prompt block needs the run-time ``query_from`` input (a window or pooling)."""
        return self.policy == "h2o" and (self.rule.prompt_window is not None or self.rule.prompt_pool > 1)

    def capacity(self, total_len: int) -> int:
        """Cache slots C for a sequence of ``total_len`` tokens (prompt + new tokens).

        ``full`` keeps everything (C = total_len); an int budget is C itself, capped at total_len
        because more slots than tokens would only waste memory.
        """
        if isinstance(total_len, bool) or not isinstance(total_len, int) or total_len < 1:
            raise ValueError(f"total_len={total_len!r} must be an int >= 1")
        if self.policy == "full":
            return total_len
        if isinstance(self.budget, int):
            cap = min(self.budget, total_len)
        else:
            cap = max(1, math.ceil(self.budget * total_len))
        self.check_split(cap)
        return cap

    def recent_window(self, capacity: int) -> int:
        """R = max(1, round(C x recent_ratio)): the newest R positions are never evicted."""
        return max(1, round(capacity * self.recent_ratio))

    def check_split(self, capacity: int) -> None:
        """ValueError when ``capacity`` slots cannot hold the sinks and the recent window this config asks for."""
        recent = self.recent_window(capacity)
        if self.sink_tokens + recent > capacity:
            raise ValueError(
                f"sink_tokens ({self.sink_tokens}) + recent window ({recent} = round({capacity} x "
                f"recent_ratio {self.recent_ratio})) exceeds the cache capacity {capacity}; "
                "raise the budget or lower sink_tokens / recent_ratio"
            )


# The names H2OConfig.from_options takes: its fields and its ScoreRule's side by side (the nested rule aside).
OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(H2OConfig) if f.name != "rule") | frozenset(_RULE_FIELDS)
