"""The eviction rule, written once in torch: how a block's attention mass becomes scores, and which entry goes.

Every torch path calls these functions: the reference op (kernels/reference.py), the compiled CPU decode step
(ops.decode_fusable_, fused by Inductor) and the bookkeeping around the Triton kernels (kernels/triton_ops.py),
whose kernels only return the attention output and the per-key mass. The ONNX function
(export/onnx_function.py) is the copy in ONNX ops, and export/native/h2o_rule.h the one in C++ that the native
ONNX Runtime op's CPU and CUDA kernels share; config/capabilities.py says which backend serves which score.

A rule travels through the op boundary as a string (custom ops take primitive arguments only),
:attr:`EvictionRule.spec`, in the config's rule syntax: a policy name (``"h2o"`` is the paper's rule) optionally
followed by options, e.g. ``"h2o+score=mean"`` or ``"h2o+decay=0.9+prompt_pool=5"``.

Scores of policy ``h2o`` are registered once in :data:`SCORES` (:func:`register_score`): a :class:`Score` says
how a query's mass enters A (a sum, or a maximum: ``peak``), how A ranks an entry (``priority``), whether it
takes a decay, or, for a query-free score, what a new entry is scored from its key alone (``key_score``).
Registered: ``sum`` (the paper's accumulated attention), ``mean`` (A / (newest - p + 1): the mass per query
that could see p), ``max`` (A = max(A, M_t), M_t(p) the query's probability of p summed over the KV group's
query heads: the key's peak attention), ``knorm`` (minus the key's L2 norm: query-free). Options shared by the
scores of attention:

    decay=g       a block of T queries t0..t1 updates A = g^T A + sum_t g^(t1 - t) mass_t (0^0 = 1), so one
                  block or T single tokens give the same A; g = 1 is the paper, g = 0 keeps the newest query
                  only (TOVA). With score="max": A = max(g^T A, max_t g^(t1 - t) M_t), the decayed peak.
    prompt_pool=k (odd) once the prompt is in, the prompt keys' A becomes its mean over the k neighbouring
                  prompt positions (fewer at the ends), SnapKV's pooling.

Which prompt queries add mass (SnapKV's observation window) is a run-time input of the op, ``query_from``
[B] int64: a query at a position below it adds nothing. The runtime passes it with the prompt block only; a
given ``query_from`` is also what marks a block as the prompt for pooling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

POLICY_CODES = {"h2o": 0, "local": 1, "sink": 2, "random": 3, "full": 4}

_LEHMER_MOD = 2147483647  # 2^31 - 1, prime: a Lehmer generator over it is a cheap integer hash
_LEHMER_MUL = 48271


@dataclass(frozen=True)
class Score:
    """One eviction key of policy ``h2o``, registered once in :data:`SCORES` (the single extension point).

    Attributes:
        name: what users write (``score="name"``, the rule string ``score=name``).
        summary: one line for help texts and the capability table.
        priority: (A [B, Hkv, S] fp32, pos [B, Hkv, S] int64, newest [B, 1, 1] int64) -> [B, Hkv, S] fp32, how
            much each entry deserves to stay (larger stays).
        peak: a query's mass enters A through a maximum (A = max(A, M_t)) instead of a sum.
        decays: takes ``decay`` < 1.
        key_score: None for a score of attention; for a query-free score, keys [B, Hkv, T, D] (as the model
            produced them) -> the score [B, Hkv, T] fp32 an entry is written with and keeps: no attention
            mass is collected, so a prompt window or pooling has nothing to act on.
        onnx_code: the integer the ONNX function (export/onnx_function.py) and the native ONNX Runtime op
            (export/native/h2o_rule.h) know this score by; None = they do not compute it (refused there by name).
    """

    name: str
    summary: str
    priority: Callable[[Tensor, Tensor, Tensor], Tensor]
    peak: bool = False
    decays: bool = True
    key_score: Optional[Callable[[Tensor], Tensor]] = None
    onnx_code: Optional[int] = None

    @property
    def reads_attention(self) -> bool:
        return self.key_score is None


SCORES: dict[str, Score] = {}


def register_score(score: Score) -> Score:
    """Add ``score`` to :data:`SCORES`; the torch paths (reference, compiled CPU step, Triton bookkeeping) serve it
    at once, the others refuse it by name until their capability entry lists it (h2o_compile/config/capabilities.py)."""
    if score.name in SCORES:
        raise ValueError(f"score {score.name!r} is registered already")
    SCORES[score.name] = score
    return score


def _accumulated(scores: Tensor, pos: Tensor, newest: Tensor) -> Tensor:
    return scores


register_score(Score("sum", "accumulated attention (the paper)", _accumulated, onnx_code=0))
register_score(Score("mean", "accumulated attention per query that could see the key", decays=False,
                     priority=lambda scores, pos, newest: scores / (newest - pos + 1).clamp(min=1).to(torch.float32),
                     onnx_code=1))
# Why a peak: keys that a model's global layers read again hundreds of tokens later had one sharp look before,
# which a (decayed) sum forgets (docs/results/eval_gemma3/probes).
register_score(Score("max", "the largest attention one query gave the key", _accumulated, peak=True, onnx_code=2))
# KnormPress's observation: keys with a small L2 norm draw the most attention; needs no attention at all.
register_score(Score("knorm", "keys with the smallest L2 norm stay (query-free)", _accumulated, decays=False,
                     key_score=lambda keys: -torch.linalg.vector_norm(keys.float(), dim=-1)))


@dataclass(frozen=True)
class EvictionRule:
    """Policy plus the score options of policy ``h2o``; validated on construction (ValueError)."""

    policy: str = "h2o"
    score: str = "sum"
    decay: float = 1.0
    pool: int = 1

    def __post_init__(self) -> None:
        if self.policy not in POLICY_CODES:
            raise ValueError(f"policy={self.policy!r}; allowed: {', '.join(POLICY_CODES)}")
        if self.score not in SCORES:
            raise ValueError(f"score={self.score!r}; allowed: {', '.join(map(repr, SCORES))}")
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay={self.decay!r} must be a number in [0, 1] (1 = no decay)")
        if isinstance(self.pool, bool) or not isinstance(self.pool, int) or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"prompt_pool={self.pool!r} must be an odd int >= 1 (1 = no pooling)")
        if self.score == "mean" and self.decay < 1.0:
            raise ValueError(f"score='mean' divides by the key's lifetime, which a decay already discounts; "
                             f"decay={self.decay!r} must be 1 with it")
        if not SCORES[self.score].decays and self.decay < 1.0:
            raise ValueError(f"score={self.score!r} takes no decay; decay={self.decay!r} must be 1 with it")
        if not SCORES[self.score].reads_attention and self.pool != 1:
            raise ValueError(f"score={self.score!r} reads no attention, so there is no prompt score to pool; "
                             f"prompt_pool={self.pool!r} must be 1 with it")
        if self.policy != "h2o" and (self.score, self.decay, self.pool) != ("sum", 1.0, 1):
            raise ValueError(f"score, decay and prompt_pool are options of policy='h2o'; "
                             f"policy={self.policy!r} does not read scores")

    @property
    def scored(self) -> bool:
        """Whether eviction reads a score at all (only ``h2o`` does; the other policies keep none)."""
        return self.policy == "h2o"

    @property
    def reads_mass(self) -> bool:
        """Whether the attention mass is collected (``h2o`` with a score of attention; the others skip it)."""
        return self.scored and SCORES[self.score].reads_attention

    @property
    def keyed(self) -> bool:
        """Whether new entries are scored from their keys (a query-free score such as ``knorm``)."""
        return self.scored and not SCORES[self.score].reads_attention

    @property
    def peak(self) -> bool:
        """Whether a query's mass enters A through a maximum (``score="max"``) rather than a sum."""
        return SCORES[self.score].peak

    @property
    def spec(self) -> str:
        """The rule string the ops carry, in the config's syntax (h2o_compile/config.py): the bare policy name
        when every option is the paper's, e.g. ``"h2o+score=max+decay=0.99+prompt_pool=21"``."""
        options = [f"score={self.score}"] * (self.score != "sum") + [f"decay={self.decay!r}"] * (self.decay != 1.0)
        options += [f"prompt_pool={self.pool}"] * (self.pool != 1)
        return "+".join([self.policy] + options)


def parse_rule(spec: str) -> EvictionRule:
    """``EvictionRule.spec`` -> the rule; a ValueError names a malformed spec. (Not cached: a few string
    operations, which dynamo evaluates once while tracing.)"""
    policy, *options = spec.split("+")
    fields = {}
    for option in options:
        name, _, value = option.partition("=")
        try:
            if name == "score":
                fields["score"] = value
            elif name == "decay":
                fields["decay"] = float(value)
            elif name == "prompt_pool":
                fields["pool"] = int(value)
            else:
                raise KeyError(name)
        except (KeyError, ValueError):
            raise ValueError(f"eviction rule {spec!r}: cannot read {option!r}; allowed: score=NAME, decay=G, "
                             "prompt_pool=K") from None
    return EvictionRule(policy, **fields)


def random_priority(pos: Tensor, seed: int) -> Tensor:
    """Seeded pseudo-random eviction priority of each position, computed with integer ops only so that
    every backend (Triton, ONNX) can reproduce it bit for bit. [...] int64 -> same shape float32."""
    x = (pos * 2654435761 + seed * 7919 + 1) % _LEHMER_MOD
    x = (x * _LEHMER_MUL) % _LEHMER_MOD
    x = (x * _LEHMER_MUL) % _LEHMER_MOD
    return x.to(torch.float32)


def live_entries(pos: Tensor, newest: Tensor, window: int) -> Tensor:
    """Entries that hold a token some later query can still see: bool, the shape of ``pos`` [B, Hkv, S].

    Empty slots (-1) are not live, nor, on a sliding-window layer (``window`` > 0), keys that left the window
    of the newest query t1 (p <= t1 - W). ``newest`` [B, 1, 1] int64."""
    live = pos >= 0
    if window > 0:
        live = live & (pos > newest - window)
    return live


def eviction_priority(rule: EvictionRule, scores: Tensor, pos: Tensor, newest: Tensor, recent: int, sinks: int,
                      seed: int, window: int = 0) -> Tensor:
    """How much each entry deserves to stay (larger stays); ties are broken by position outside.

    Args:
        scores: [B, Hkv, S] fp32 accumulated attention.
        pos: [B, Hkv, S] int64 positions, -1 for an empty slot.
        newest: [B, 1, 1] int64, t1 = the newest position of the block in each row.
        window: sliding window W of the layer, 0 = none.
    Returns:
        [B, Hkv, S] fp32: +inf for protected entries (sinks and the recent window), -inf for entries that are
        not live (empty slots, keys outside the sliding window), which go first whatever their protection.
    """
    if rule.scored:
        key = SCORES[rule.score].priority(scores, pos, newest)
    elif rule.policy == "random":
        key = random_priority(pos, seed)
    else:
        key = pos.to(torch.float32)  # local, sink: oldest first; `full` never evicts when sized right
    protected = (pos < sinks) | (pos > newest - recent)
    key = torch.where(protected, torch.full_like(key, float("inf")), key)
    return torch.where(live_entries(pos, newest, window), key, torch.full_like(key, float("-inf")))


def query_weights(rule: EvictionRule, positions: Tensor, valid: Tensor, query_from: Optional[Tensor]
                  ) -> Optional[Tensor]:
    """How much each query's attention adds to the scores: [B, T] fp32, or None when every valid query adds
    its mass as it is (the paper's rule, and every policy that does not read scores).

    Args:
        positions: [B, T] int64; valid: [B, T] bool; query_from: [B] int64 or None (module docstring).
    Returns:
        w[b, t] = valid x (positions >= query_from) x decay^(t1 - t), t1 the row's newest valid position.
    """
    if not rule.reads_mass or (rule.decay == 1.0 and query_from is None):
        return None
    weights = valid.to(torch.float32)
    if query_from is not None:
        weights = weights * (positions >= query_from[:, None]).to(torch.float32)
    if rule.decay != 1.0:
        newest = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=1, keepdim=True)
        age = (newest - positions).clamp(min=0).to(torch.float32)                   # [B, T]
        weights = weights * torch.pow(torch.full_like(age, rule.decay), age)       # 0^0 = 1
    return weights


def carried_scores(rule: EvictionRule, scores: Tensor, valid: Tensor) -> Tensor:
    """The cached scores [B, Hkv, C] carried into a block of ``valid`` [B, T] queries: decay^(valid count of
    the row) x A, or A itself without decay."""
    if rule.decay == 1.0 or not rule.reads_mass:
        return scores
    steps = valid.sum(dim=1).to(torch.float32).view(-1, 1, 1)                      # [B, 1, 1]
    return scores * torch.pow(torch.full_like(steps, rule.decay), steps)


def accumulate(rule: EvictionRule, carried: Tensor, mass: Tensor) -> Tensor:
    """A after a block: the carried scores plus the block's mass, or their maximum under ``score="max"``
    (the mass then being the block's column maximum of weighted per-query masses). Same shapes in and out."""
    return torch.maximum(carried, mass) if rule.peak else carried + mass


def pool_block_scores(rule: EvictionRule, scores: Tensor, new_valid: Tensor) -> Tensor:
    """SnapKV's pooling of the prompt keys' scores: the mean over the k neighbouring valid block entries.

    Args:
        scores: [B, Hkv, T] fp32 of the block's own keys (positions increase along T, padding at the left).
        new_valid: [B, T] bool.
    Returns:
        [B, Hkv, T]; the scores as they are when ``rule.pool`` is 1.
    """
    if rule.pool == 1 or not rule.reads_mass:
        return scores
    b, hkv, t = scores.shape
    mask = new_valid.to(scores.dtype)[:, None, :].expand(b, hkv, t).reshape(b * hkv, 1, t)
    ones = scores.new_ones(1, 1, rule.pool)
    half = rule.pool // 2
    total = F.conv1d(scores.reshape(b * hkv, 1, t) * mask, ones, padding=half)
    count = F.conv1d(mask, ones, padding=half).clamp(min=1.0)
    return (total / count).view(b, hkv, t)
