"""An independent brute-force H2O simulation: the whole history kept, sets and dicts, float64, plain loops.

Written from docs/design.md section 2 without looking at kernels/reference.py; the tests compare every backend
against it. One simulated cache per (batch row, KV head).

Attention kinds (docs/design.md section 2): ``window`` W (a query at t sees key p only if t - p < W; a key that left
the window is dropped before any eviction choice), ``softcap`` (logits = cap * tanh(logits / cap)) and
``sink_logits`` (one extra logit per query head of the group in the softmax denominator, receiving no score).

Rolling positions (``inv_freq`` given, [R / 2] float64): keys and queries arrive unrotated; at each block the
kept positions are numbered 0..n-1 in increasing order and the block's tokens n, n+1, ...; both are rotated
with these numbers (angle = number x inv_freq[i], pairing dims i and i + R/2, dims >= R untouched). With
``max_distance`` D > 0 (capped distances) the block's newest token L sits at D' = max(D, n - 1), n the block's
valid tokens, and every other key or query p at D' - min(L - p, D'): its true distance to L, capped at D'.

Score rules (docs/design.md section 2, "Score rules"), simulated query by query rather than in closed form: before
each valid query adds its probabilities, every score is multiplied by ``decay``; a query whose position is not
in ``counted`` adds nothing (a prompt window); after a ``prompt`` block with ``pool`` k > 1 each of the block's
keys takes the mean score of the block's keys within k // 2 positions; ``score="mean"`` evicts by
score / (newest - p + 1); ``score="max"`` replaces a score by the larger of it and the query's probability
summed over the group's heads, instead of adding that.

Quantized entries (``quantized=True``, docs/design.md section 2 "Quantized entries"): a key or value is rounded to
s * round(x / s) with s = max|x| / 127 when it is stored; the block that brings it reads the exact vector, every
later block the stored one.
"""

from __future__ import annotations

import math

import torch

MOD = 2147483647


def random_key(pos: int, seed: int) -> int:
    x = (pos * 2654435761 + seed * 7919 + 1) % MOD
    x = (x * 48271) % MOD
    return (x * 48271) % MOD


def int8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x [D] float64 -> s * clamp(round(x / s), -127, 127), s = max|x| / 127 (1 for a zero vector), element by
    element with Python floats."""
    top = max(abs(float(e)) for e in x)
    s = top / 127 if top > 0 else 1.0
    return torch.tensor([s * max(-127, min(127, round(float(e) / s))) for e in x], dtype=torch.float64)


class SimulatedCache:
    """Kept positions S and their scores A for one (row, KV head); keys/values of every token ever seen."""

    def __init__(self, capacity, recent, sinks, policy, seed=0, window=None, softcap=None, sink_logits=None,
                 inv_freq=None, score="sum", decay=1.0, pool=1, quantized=False, max_distance=0):
        self.capacity, self.recent, self.sinks, self.policy, self.seed = capacity, recent, sinks, policy, seed
        self.score_rule, self.decay, self.pool = score, decay, pool
        self.window, self.softcap, self.sink_logits = window, softcap, sink_logits
        self.inv_freq, self.max_distance = inv_freq, max_distance
        self.quantized = quantized
        self.kept: set[int] = set()
        self.score: dict[int, float] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (key, value) as the cache holds them

    def block(self, positions, q, k, v, scale, counted=None, prompt=False):
        """positions: list of valid new positions (ascending); q: [G, T, D]; k, v: [T, D] (float64).
        counted: the query positions that add to the scores (None = all); prompt: pool after this block.
        Returns the outputs [G, T, Dv] for those positions."""
        if self.max_distance:
            far = max(self.max_distance, len(positions) - 1)
            newest = max(positions)
            number = {p: far - min(newest - p, far) for p in self.kept | set(positions)}
        else:
            number = {p: i for i, p in enumerate(sorted(self.kept))}
            number.update({p: len(self.kept) + j for j, p in enumerate(positions)})
        for j, p in enumerate(positions):
            self.keys[p], self.values[p] = k[j], v[j]
            quantize = int8_roundtrip if self.quantized else (lambda x: x)
            self.stored[p] = (quantize(k[j]), quantize(v[j]))
            # knorm reads no attention: a key scores minus its L2 norm (as produced, before any quantization).
            self.score[p] = -float(k[j].norm()) if self.score_rule == "knorm" else 0.0
        new = set(positions)
        outs = torch.zeros(q.shape[0], len(positions), v.shape[-1], dtype=torch.float64)
        for i, t in enumerate(positions):
            visible = sorted(p for p in self.kept | {p for p in new if p <= t}
                             if self.window is None or t - p < self.window)
            # The block's own tokens are read exactly; what an earlier block left is read as stored.
            keys = torch.stack([self.turn(self.keys[p] if p in new else self.stored[p][0], number[p])
                                for p in visible])
            values = torch.stack([self.values[p] if p in new else self.stored[p][1] for p in visible])
            query_mass = [0.0] * len(visible)  # this query's probabilities summed over the group's heads
            for g in range(q.shape[0]):
                logits = [float(self.turn(q[g, i], number[t]) @ key) * scale for key in keys]
                if self.softcap is not None:
                    logits = [self.softcap * math.tanh(x / self.softcap) for x in logits]
                sink = None if self.sink_logits is None else float(self.sink_logits[g])
                top = max(logits + ([] if sink is None else [sink]))
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights) + (0.0 if sink is None else math.exp(sink - top))
                probs = [w / total for w in weights]
                outs[g, i] = sum(pr * val for pr, val in zip(probs, values))
                if g == 0:  # time passes once per query, not once per head of the group
                    for p in self.score:
                        self.score[p] *= self.decay
                query_mass = [m + pr for m, pr in zip(query_mass, probs)]
            # Only h2o reads scores; the other policies keep none (every backend leaves them at 0).
            if self.policy == "h2o" and self.score_rule != "knorm" and (counted is None or t in counted):
                for p, m in zip(visible, query_mass):
                    self.score[p] = max(self.score[p], m) if self.score_rule == "max" else self.score[p] + m
        if prompt and self.pool > 1:
            half = self.pool // 2
            pooled = {p: [self.score[n] for n in positions if abs(n - p) <= half] for p in positions}
            self.score.update({p: sum(near) / len(near) for p, near in pooled.items()})
        self.kept |= new
        if positions:
            self._evict(newest=max(positions))
        return outs

    def turn(self, x, number):
        """x [D] rotated to ``number`` (rolling positions), or x itself with true positions."""
        if self.inv_freq is None:
            return x
        out = x.clone()
        half = len(self.inv_freq)
        for i, freq in enumerate(self.inv_freq.tolist()):
            c, s = math.cos(number * freq), math.sin(number * freq)
            out[i] = x[i] * c - x[i + half] * s
            out[i + half] = x[i + half] * c + x[i] * s
        return out

    def _evict(self, newest):
        if self.window is not None:
            self.kept = {p for p in self.kept if p > newest - self.window}
        while len(self.kept) > self.capacity and self.policy != "full":
            candidates = [p for p in self.kept if not (p < self.sinks or p > newest - self.recent)]
            if self.policy == "h2o" and self.score_rule == "mean":
                victim = min(candidates, key=lambda p: (self.score[p] / (newest - p + 1), p))
            elif self.policy == "h2o":
                victim = min(candidates, key=lambda p: (self.score[p], p))
            elif self.policy == "random":
                victim = min(candidates, key=lambda p: (random_key(p, self.seed), p))
            else:  # local, sink: oldest first
                victim = min(candidates)
            self.kept.remove(victim)
