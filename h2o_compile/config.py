"""H2OConfig: what to keep in the KV cache, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from .kernels.quantized import check_kv_dtype
from .kernels.rules import SCORES, EvictionRule

POSITIONS = ("true", "rolling", "capped")
POLICIES = ("h2o", "local", "sink", "random", "full")

# StreamingLLM keeps four "attention sink" tokens; the `sink` policy uses that unless told otherwise.
DEFAULT_SINK_POLICY_SINKS = 4


@dataclass
class H2OConfig:
    """How an H2O cache is sized and which tokens it evicts.

    Args:
        budget: float in (0, 1] = fraction of the total sequence (prompt + new tokens) kept per layer and
            KV head; int >= 1 = that many cache slots.
        recent_ratio: fraction of the capacity reserved for the most recent tokens (the paper splits the
            budget evenly between recent tokens and heavy hitters).
        sink_tokens: the first ``sink_tokens`` positions are never evicted. ``None`` means 0, or 4 for the
            ``sink`` policy (StreamingLLM).
        policy: ``h2o`` (evict the smallest accumulated attention), ``local`` (oldest first),
            ``sink`` (sinks, then oldest first), ``random`` (seeded), ``full`` (never evict).
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
            part of their window. 1.0 = every layer C (the paper). Gemma 3 270M, budget 0.2 of 1024 tokens:
            2.0 brings perplexity from 1.15x to 1.04x the full cache's with the recommended rule
            (docs/results/eval_gemma3, "Slots by kind of layer").
        positions: ``"true"`` rotates keys at their text positions (the model's own behaviour);
            ``"rolling"`` caches keys before RoPE and rotates them by their rank in the cache at attention
            time (StreamingLLM), so a stream can run past the model's max_position_embeddings with every
            relative distance below C + block (rotary models only). ``"capped"`` caches keys before RoPE
            too and rotates each at its true distance to the row's newest token, capped at ``max_distance``
            (at the block's valid tokens - 1 if that is more, so a block's own distances stay exact):
            recent keys sit where the model expects them, older ones at that one far distance (measured
            better than rank over long streams, docs/results/stream/README.md).
        max_distance: D of ``positions="capped"``: None = half the model's max_position_embeddings (the best
            of the caps measured on Gemma 3 270M); an int in [1, max_position_embeddings - 1].
        score: the eviction key of policy ``h2o``: ``"sum"`` (the paper: accumulated attention), ``"mean"``
            (accumulated attention / (newest position - p + 1), the key's lifetime) or ``"max"`` (the largest
            attention one query gave the key, summed over its KV group's heads: A = max(A, mass_t)).
        score_decay: g in [0, 1]; a block of T queries updates A = g^T A + sum_t g^(t1 - t) mass_t (with
            ``"max"``: A = max(g^T A, max_t g^(t1 - t) mass_t)). 1 = the paper, 0 = the newest query only
            (TOVA). Not with ``score="mean"``.
        prompt_window: None, or w >= 1: only the prompt's last w queries add to the scores (SnapKV's
            observation window); later queries add as usual. The prompt is the first block after ``reset``.
        prompt_pool: odd k >= 1: once the prompt is in, its keys' scores are averaged over k neighbouring
            prompt positions (SnapKV's pooling); needs ``prefill="full"``.
        kv_dtype: ``"model"`` keeps kept keys and values in the model's dtype; ``"int8"`` stores each kept
            key and value vector as int8 with one fp32 scale (symmetric absmax, kernels/quantized.py), about a
            quarter of the fp32 state. Scores, positions and eviction are unchanged.
        sliding_score: None (every layer evicts by ``score``), or the score of the sliding-window layers when
            ``compress_sliding`` puts them under the policy; ``score`` is then the full-attention layers' own.
            Decay, prompt window and pooling are shared. Gemma 3 270M with ``global_share=2``, budget 0.2,
            decay 0.99: ``score="max", sliding_score="sum"`` 1.029x the full cache's perplexity on wikitext-2
            at 1024 tokens (the sum on every layer 1.041x, the peak 1.100x) and 0.979x at 4096 (sum 0.986x);
            level with both on War and Peace (1.053x vs 1.051x) (docs/results/eval_gemma3, "A score per kind
            of layer").
    """

    budget: Union[float, int] = 0.2
    recent_ratio: float = 0.5
    sink_tokens: Optional[int] = None
    policy: str = "h2o"
    prefill: Union[str, int] = "full"
    seed: int = 0
    compress_sliding: bool = False
    global_share: float = 1.0
    positions: str = "true"
    max_distance: Optional[int] = None
    score: str = "sum"
    score_decay: float = 1.0
    prompt_window: Optional[int] = None
    prompt_pool: int = 1
    kv_dtype: str = "model"
    sliding_score: Optional[str] = None

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
            raise ValueError(f"policy={self.policy!r} is not supported; choose one of {', '.join(POLICIES)}")
        if not isinstance(self.recent_ratio, (int, float)) or not (0.0 <= self.recent_ratio <= 1.0):
            raise ValueError(f"recent_ratio={self.recent_ratio!r} must be a number in [0, 1]")
        if self.sink_tokens is None:
            self.sink_tokens = DEFAULT_SINK_POLICY_SINKS if self.policy == "sink" else 0
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens={self.sink_tokens!r} must be an int >= 0")
        if self.policy == "local" and self.sink_tokens:
            raise ValueError(
                f"policy='local' keeps no sinks but sink_tokens={self.sink_tokens}; use policy='sink' instead"
            )
        if isinstance(self.prefill, str):
            if self.prefill != "full":
                raise ValueError(f"prefill={self.prefill!r} must be 'full' or an int chunk size >= 1")
        elif isinstance(self.prefill, bool) or not isinstance(self.prefill, int) or self.prefill < 1:
            raise ValueError(f"prefill={self.prefill!r} must be 'full' or an int chunk size >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be an int >= 0")
        if not isinstance(self.compress_sliding, bool):
            raise ValueError(f"compress_sliding={self.compress_sliding!r} must be True or False")
        self._check_global_share()
        if self.positions not in POSITIONS:
            raise ValueError(f"positions={self.positions!r}; allowed: {', '.join(map(repr, POSITIONS))}")
        if self.max_distance is not None:
            if isinstance(self.max_distance, bool) or not isinstance(self.max_distance, int) or self.max_distance < 1:
                raise ValueError(f"max_distance={self.max_distance!r} must be None or an int >= 1")
            if self.positions != "capped":
                raise ValueError(f"max_distance={self.max_distance} caps the distances of positions='capped'; "
                                 f"positions={self.positions!r} has none")
        if self.score not in SCORES:
            raise ValueError(f"score={self.score!r}; allowed: {', '.join(map(repr, SCORES))}")
        if self.prompt_window is not None and (isinstance(self.prompt_window, bool)
                                               or not isinstance(self.prompt_window, int) or self.prompt_window < 1):
            raise ValueError(f"prompt_window={self.prompt_window!r} must be None (every prompt query scores) or "
                             "an int >= 1")
        if self.policy != "h2o" and self.prompt_window is not None:
            raise ValueError(f"prompt_window is an option of policy='h2o'; policy={self.policy!r} reads no scores")
        _ = self.rule  # validates score, score_decay and prompt_pool together
        self._check_sliding_score()
        check_kv_dtype(self.kv_dtype)
        if self.prompt_pool > 1 and self.prefill != "full":
            raise ValueError(f"prompt_pool={self.prompt_pool} pools the whole prompt's scores, which needs "
                             f"prefill='full'; got prefill={self.prefill!r}")
        if isinstance(self.budget, int):
            self._check_split(self.budget)

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

    def layer_shares(self, windows: Sequence[int], capacity: Optional[int] = None,
                     total_len: Optional[int] = None) -> list[float]:
        """Each layer's slots as a multiple of C (``global_share``), given every layer's sliding window
        (0 = full attention); all 1.0 by default. With ``capacity`` C (and ``total_len``, None for a stream)
        the shares of that plan, which holds the uniform split's slots: C per full-attention layer plus
        min(C, W) per sliding one. Without it, the shares while C <= every window, which any length's plan
        is checked against first. ValueError when the model lacks one kind of layer or the full-attention
        layers would take every slot."""
        windows, share = list(windows), float(self.global_share)
        if share == 1.0:
            return [1.0] * len(windows)
        full = sum(1 for w in windows if w <= 0)
        sliding = len(windows) - full
        if not full or not sliding:
            raise ValueError(f"global_share={self.global_share!r} moves slots between full-attention and "
                             f"sliding-window layers; this model has {full} full-attention and {sliding} "
                             "sliding-window layers (use global_share=1.0)")
        rest = (len(windows) - share * full) / sliding
        if rest <= 0:
            raise ValueError(f"global_share={self.global_share!r}: {full} full-attention layers of "
                             f"{len(windows)} would hold every slot; allowed: below {len(windows) / full:g}")
        if capacity is not None:
            rest = self._sliding_share(windows, capacity, total_len, full, sliding, share)
        return [rest if w > 0 else share for w in windows]

    def _sliding_share(self, windows: list[int], capacity: int, total_len: Optional[int], full: int,
                       sliding: int, share: float) -> float:
        """A sliding-window layer's slots as a multiple of C: the uniform split's slots less the full layers'
        global_share x C (at most the sequence), shared equally (rounded: within half a slot per layer)."""
        full_slots = self.layer_params(total_len, 0, capacity, share)[0]
        uniform = sum(self.layer_params(total_len, w, capacity)[0] for w in windows)
        left = uniform - full * full_slots
        each = round(left / sliding)
        if each < 1 or self.sink_tokens + self.recent_window(each) > each:
            least = next(n for n in range(1, capacity + 2) if self.sink_tokens + self.recent_window(n) <= n)
            length = "a stream" if total_len is None else f"{total_len} tokens"
            raise ValueError(f"global_share={self.global_share!r} at C={capacity} slots ({length}): the {full} "
                             f"full-attention layers' {full_slots} slots each leave {left} of the uniform split's "
                             f"{uniform} for {sliding} sliding-window layers, {each} each, fewer than the {least} "
                             f"that sink_tokens ({self.sink_tokens}) and a recent window need; global_share <= "
                             f"{(uniform - sliding * least) // full / capacity:.4f} leaves them {least}")
        return left / (sliding * capacity)  # layer_params rounds it x C back to ``each``

    def _check_sliding_score(self) -> None:
        if self.sliding_score is None:
            return
        if self.sliding_score not in SCORES:
            raise ValueError(f"sliding_score={self.sliding_score!r}; allowed: None (the layers share score) or "
                             f"{', '.join(map(repr, SCORES))}")
        if self.policy != "h2o":
            raise ValueError(f"sliding_score={self.sliding_score!r} is an option of policy='h2o'; "
                             f"policy={self.policy!r} reads no scores")
        if not self.compress_sliding:
            raise ValueError(f"sliding_score={self.sliding_score!r} is the score of the sliding-window layers that "
                             "compress_sliding=True puts under the policy; without it they keep their window and "
                             "never choose")
        try:
            self.rule_for(window=1)  # the sliding layers' score with the shared decay and pooling
        except ValueError as exc:
            raise ValueError(f"sliding_score={self.sliding_score!r}: {exc}") from None

    def layer_rules(self, windows: Sequence[int]) -> list[str]:
        """The ``EvictionRule.spec`` of every layer (``windows``: each layer's sliding window, 0 = full
        attention), what the graph's h2o ops carry. ValueError when ``sliding_score`` is given for a model that
        lacks one of the two kinds of layer (it would silently do nothing, or replace ``score`` on every
        layer)."""
        sliding = sum(1 for w in windows if w > 0)
        if self.sliding_score is not None and sliding in (0, len(windows)):
            kind = "no sliding-window layer" if sliding == 0 else "no full-attention layer"
            raise ValueError(f"sliding_score={self.sliding_score!r} sets the sliding-window layers' score apart "
                             f"from the full-attention layers', but this model has {kind}; use score= alone")
        return [self.rule_for(window).spec for window in windows]

    @property
    def rule(self) -> EvictionRule:
        """The eviction rule of the full-attention layers, and of every layer without ``sliding_score``
        (kernels/rules.py); its ``spec`` is what the graph carries."""
        return EvictionRule(self.policy, self.score, self.score_decay, self.prompt_pool)

    def rule_for(self, window: int) -> EvictionRule:
        """The eviction rule of a layer whose sliding window is ``window`` (0 = full attention)."""
        if window > 0 and self.sliding_score is not None:
            return EvictionRule(self.policy, self.sliding_score, self.score_decay, self.prompt_pool)
        return self.rule

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
        return self.policy == "h2o" and (self.prompt_window is not None or self.prompt_pool > 1)

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
        self._check_split(cap)
        return cap

    def recent_window(self, capacity: int) -> int:
        """R = max(1, round(C x recent_ratio)): the newest R positions are never evicted."""
        return max(1, round(capacity * self.recent_ratio))

    def layer_params(self, total_len: Optional[int], window: int, capacity: Optional[int] = None,
                     share: float = 1.0) -> tuple[int, int, int]:
        """(capacity, recent window, sink tokens) of one layer for a sequence of ``total_len`` tokens, or,
        for a stream of unknown length (``total_len`` None), for the fixed ``capacity`` C.

        A full-attention layer (``window`` 0) gets C = capacity(total_len). A sliding-window layer keeps
        min(W, total_len) slots, all protected (only keys that left the window are evicted: no choice to
        make), or with ``compress_sliding`` min(C, W) slots under the policy. ``share`` (the layer's entry of
        :meth:`layer_shares`) scales C first: round(share x C), at most total_len.
        """
        if total_len is None:
            if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
                raise ValueError(f"capacity={capacity!r} must be an int >= 1 for a stream without max_seq_len")
            self._check_split(capacity)
            cap, total_len = capacity, None
        else:
            cap = self.capacity(total_len)
        if share != 1.0:
            cap = max(1, round(cap * share))
            cap = cap if total_len is None else min(cap, total_len)
        if total_len is None:
            total_len = window if window > 0 else cap
        if window <= 0:
            self._check_split(cap)
            return cap, self.recent_window(cap), self.layer_sinks(window)
        if not self.compress_sliding:
            slots = min(window, total_len)
            return slots, slots, self.layer_sinks(window)
        slots = min(cap, window)
        self._check_split(slots)
        return slots, self.recent_window(slots), self.layer_sinks(window)

    def layer_sinks(self, window: int) -> int:
        """Sink tokens of a layer: none on a sliding-window layer that keeps its window (it never chooses)."""
        return 0 if window > 0 and not self.compress_sliding else self.sink_tokens

    def _check_split(self, capacity: int) -> None:
        recent = self.recent_window(capacity)
        if self.sink_tokens + recent > capacity:
            raise ValueError(
                f"sink_tokens ({self.sink_tokens}) + recent window ({recent} = round({capacity} x "
                f"recent_ratio {self.recent_ratio})) exceeds the cache capacity {capacity}; "
                "raise the budget or lower sink_tokens / recent_ratio"
            )
