"""Streaming at constant memory: one long token stream through one fixed-capacity cache.

The stream is fed in chunks (``H2OModel.step`` on a ``reset(1, capacity=C)`` cache, H2OConfig.prefill = the
chunk), each chunk's logits scoring the next tokens (teacher forcing), so every prediction after the first C
tokens is made from the compressed cache. Per window of the stream: perplexity, tokens/s and the process's
resident memory. This is the paper's streaming experiment (and StreamingLLM's): a cache of C slots over a
stream many times the model's trained positions, compared between policies and position schemes.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from ..config import POLICIES, POSITIONS, H2OConfig, parse_options
from ..graph.support import check_supported
from ..runtime.model import optimize


def resident_bytes() -> int:
    """The process's resident set size now (Linux /proc; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class StreamWindow:
    start: int                 # first scored position of the window in the stream
    end: int                   # one past its last
    perplexity: float
    tokens_per_s: float        # fed tokens per second of wall time while scoring this window
    rss_mib: float             # resident memory at the window's end


@dataclass
class StreamRun:
    policy: str
    positions: str
    capacity: int
    chunk: int
    sink_tokens: int
    tokens: int
    kv_bytes: int              # the H2O state (keys, values, scores, positions) of the whole stream
    perplexity: float          # over every scored token of the stream
    windows: list[StreamWindow] = field(default_factory=list)
    seconds: float = 0.0
    rule: str = "sum"          # the h2o score rule (quality/task_eval.py's names); "-" for other policies
    recent_ratio: float = 0.5
    recent_slots: int = 0      # R, the slots of the recent window (ages below R are the window's, not the rule's)
    # At the stream's end, the age (newest position - p) of every key the full-attention layers keep, summed over
    # those layers and KV heads, counted per bin [edges[i], edges[i+1]); whether old keys hold the cache.
    age_edges: list[int] = field(default_factory=list)
    age_counts: list[int] = field(default_factory=list)
    max_distance: int = 0      # the cap of positions="capped" (resolved: the model's default included)
    compress_sliding: bool = False  # sliding-window layers under the policy too (min(C, W) slots)

    @property
    def label(self) -> str:
        rule = f" [{self.rule}]" if self.policy == "h2o" and self.rule != "sum" else ""
        recent = f" recent {self.recent_ratio:g}" if self.recent_ratio != 0.5 else ""
        scheme = f"distances capped at {self.max_distance:,}" if self.max_distance else f"{self.positions} positions"
        sliding = ", sliding layers compressed" if self.compress_sliding else ""
        return f"{self.policy}{rule}{recent} ({scheme}{sliding})"

    def summary(self) -> dict:
        """The figures the targets speak of: last window vs the first full one (the first window that starts
        after eviction began, i.e. after position C; None when no window does), RSS growth from 10% of the
        stream to the end, throughput at both ends."""
        full = next((w for w in self.windows if w.start > self.capacity), None)
        tenth = next((w for w in self.windows if w.end >= self.tokens // 10), self.windows[0])
        last = self.windows[-1]
        return {
            "first_full_window_ppl": full and full.perplexity, "last_window_ppl": last.perplexity,
            "last_vs_first_full": full and last.perplexity / full.perplexity,
            "rss_growth_from_10pct": (last.rss_mib - tenth.rss_mib) / tenth.rss_mib if tenth.rss_mib else None,
            "tokens_per_s_first": (full or self.windows[0]).tokens_per_s, "tokens_per_s_last": last.tokens_per_s,
        }


def age_bin_edges(tokens: int, *marks: int) -> list[int]:
    """Bin edges for the ages of kept keys in a stream of ``tokens``: 0, powers of two up to the stream (a cache
    holds mostly young keys; the question is how many old ones it still holds), and ``marks`` (the recent
    window R and 4 C), so the report's figures at those ages are exact, not read off a power-of-two bin."""
    edges = {0, 1}
    top = 1
    while top < tokens:
        top *= 2
        edges.add(top)
    edges.update(mark for mark in marks if 0 < mark < top)
    return sorted(edges)


def kept_age_histogram(opt, newest: int, edges: Sequence[int]) -> list[int]:
    """Counts of kept keys per age bin [edges[i], edges[i+1]) (age = ``newest`` - position), over every
    full-attention layer, batch row and KV head of ``opt`` (an H2OModel after a stream). Sliding-window layers
    are left out: their window, not the policy, decides what they hold."""
    ages = [newest - opt.kept_positions(i) for i, window in enumerate(opt.limits.windows) if not window]  # [B, Hkv, C]
    if not ages:
        return [0] * (len(edges) - 1)
    kept = torch.cat([a[a <= newest].flatten() for a in ages])                # empty slots hold -1: age > newest
    counts = torch.histogram(kept.double().cpu(), bins=torch.tensor(edges, dtype=torch.float64)).hist
    return [int(c) for c in counts]


def _check(tokens: int, capacity: int, chunk: int, window_tokens: int, policy: str, positions: str) -> None:
    for name, value in (("tokens", tokens), ("capacity", capacity), ("chunk", chunk),
                        ("window_tokens", window_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if tokens < 2:
        raise ValueError(f"tokens={tokens} must be >= 2 (each scored token needs the one before it)")
    if policy not in POLICIES or policy == "full":
        raise ValueError(f"policy={policy!r}; a stream needs an evicting policy: "
                         f"{', '.join(p for p in POLICIES if p != 'full')}")
    if positions not in POSITIONS:
        raise ValueError(f"positions={positions!r}; allowed: {', '.join(POSITIONS)}")


@torch.no_grad()
def stream_perplexity(model, token_ids: torch.Tensor, *, capacity: int, chunk: int = 64, policy: str = "h2o",
                      positions: str = "rolling", sink_tokens: Optional[int] = None, window_tokens: int = 4096,
                      rule: str = "sum", recent_ratio: float = 0.5, progress: bool = True,
                      desc: Optional[str] = None, max_distance: Optional[int] = None,
                      compress_sliding: bool = False) -> StreamRun:
    """Feed ``token_ids`` [N] as one stream through ``capacity`` slots; perplexity per window of the stream.

    Args:
        model: a transformers causal LM (optimize() is applied here, eager).
        capacity: C slots per layer and KV head (sliding-window layers: their window, as H2OConfig says).
        chunk: tokens per step (memory stays at C + chunk).
        policy, positions, sink_tokens, recent_ratio, max_distance, compress_sliding: as H2OConfig
            (sink_tokens None = the policy's default; max_distance only with positions "capped", None = the
            model's default).
        window_tokens: scored tokens per reported window.
        rule: the score rule of policy h2o, by the names of ``tasks --rules`` ("sum", "mean", "max", "tova",
            "decay=0.99", "global=2+decay=0.99" with compress_sliding, ...); ignored by the other policies. A
            prompt window or pooling has no prompt to act on in a chunked stream and is refused.
    Returns:
        a StreamRun; windows cover positions 1..N-1 (position 0 has nothing to be predicted from).
    """
    tokens = int(token_ids.numel())
    _check(tokens, capacity, chunk, window_tokens, policy, positions)
    options = stream_rule_options(rule, compress_sliding) if policy == "h2o" else {}
    opt = optimize(model, budget=capacity, policy=policy, positions=positions, prefill=chunk,
                   sink_tokens=sink_tokens, recent_ratio=recent_ratio, compile=False, max_distance=max_distance,
                   compress_sliding=compress_sliding, **options)
    opt.reset(1, capacity=capacity)
    ids = token_ids.reshape(1, -1).long()
    run = StreamRun(policy, positions, capacity, chunk, opt.h2o_config.sink_tokens, tokens, opt.kv_cache_bytes(),
                    float("nan"), rule=rule if policy == "h2o" else "-",
                    recent_ratio=recent_ratio, max_distance=opt.h2o_config.position_cap(opt.limits.max_positions),
                    compress_sliding=compress_sliding)
    total_nll, window_nll, window_count, window_start = 0.0, 0.0, 0, 1
    start_time = window_time = time.perf_counter()
    bar = tqdm(total=tokens, unit="tok", desc=desc or f"{policy}/{positions}", disable=not progress,
               mininterval=1.0)
    for start in range(0, tokens - 1, chunk):
        block = ids[:, start:min(start + chunk, tokens - 1)]                 # the last token only is a target
        logits = opt.step(block)                                             # [1, c, V]
        targets = ids[0, start + 1:start + 1 + block.shape[1]]
        nll = torch.nn.functional.cross_entropy(logits[0].float(), targets, reduction="none").double()  # [c]
        offset = 0
        while offset < nll.numel():  # a chunk may close a window part-way
            take = min(nll.numel() - offset, window_tokens - window_count)
            window_nll += float(nll[offset:offset + take].sum())
            window_count += take
            offset += take
            end = start + 1 + offset
            if window_count == window_tokens or end == tokens:
                now = time.perf_counter()
                run.windows.append(StreamWindow(window_start, end, math.exp(window_nll / window_count),
                                                window_count / (now - window_time), resident_bytes() / 2**20))
                total_nll += window_nll
                window_nll, window_count, window_start, window_time = 0.0, 0, end, now
        bar.update(block.shape[1])
        if run.windows:
            elapsed = time.perf_counter() - start_time
            bar.set_postfix(tok_s=f"{(start + block.shape[1]) / elapsed:.0f}", rss=f"{resident_bytes() / 2**20:.0f}MiB",
                            ppl=f"{run.windows[-1].perplexity:.2f}", refresh=False)
    bar.update(1)  # the last token, scored but never fed
    bar.close()
    run.recent_slots = opt.h2o_config.recent_window(capacity) if policy == "h2o" else 0
    run.age_edges = age_bin_edges(tokens, run.recent_slots, 4 * capacity)
    run.age_counts = kept_age_histogram(opt, tokens - 2, run.age_edges)     # token N-2 was the last one fed
    run.seconds = time.perf_counter() - start_time
    run.perplexity = math.exp(total_nll / (tokens - 1))
    return run


def stream_rule_options(rule: str, compress_sliding: bool = False) -> dict:
    """H2OConfig keywords of an h2o score rule for a stream; a ValueError for rules a stream cannot honour."""
    options = parse_options(rule)
    if options.get("prompt_window") is not None or options.get("prompt_pool", 1) != 1:
        raise ValueError(f"score rule {rule!r}: a stream is fed in chunks and has no prompt for a prompt window or "
                         "pooling (window=, pool=, snapkv) to act on; use sum, mean, max, tova, decay=G, global=S or "
                         "sliding=SCORE, joined by '+'")
    if "global_share" in options and not compress_sliding:
        raise ValueError(f"score rule {rule!r}: global= splits slots between compressed sliding-window and "
                         "full-attention layers; without compress_sliding (--compress-sliding) a stream's "
                         "sliding-window layers keep their window")
    if "recent_ratio" in options:
        raise ValueError(f"score rule {rule!r}: give the recent window's share once, as --recent-ratio "
                         "(recent_ratio=), not as recent= in the rule")
    return options


def stream_runs(model, token_ids: torch.Tensor, *, capacity: int, chunk: int, policies: Sequence[str],
                positions: Sequence[str], sink_tokens: Optional[int] = None, window_tokens: int = 4096,
                rules: Sequence[str] = ("sum",), recent_ratio: float = 0.5, progress: bool = True,
                on_run=None, max_distance: Optional[int] = None,
                compress_sliding: bool = False) -> list[StreamRun]:
    """Every (policy [x rule for h2o], positions) over the same stream; ``on_run(runs so far)`` after each.
    ``max_distance`` applies to the "capped" scheme."""
    for rule in rules:
        stream_rule_options(rule, compress_sliding)  # every rule checked before the first long run
    if max_distance is not None and "capped" not in positions:
        raise ValueError(f"max_distance={max_distance} caps positions 'capped', which is not among "
                         f"{', '.join(positions)}")
    if "capped" in positions:  # the cap against the model's positions, before the first long run
        H2OConfig(positions="capped", max_distance=max_distance).position_cap(check_supported(model).max_positions)
    runs = []
    for policy in policies:
        for rule in (rules if policy == "h2o" else ["sum"]):
            for scheme in positions:
                runs.append(stream_perplexity(model, token_ids, capacity=capacity, chunk=chunk, policy=policy,
                                              positions=scheme, sink_tokens=sink_tokens,
                                              window_tokens=window_tokens, rule=rule, recent_ratio=recent_ratio,
                                              progress=progress,
                                              max_distance=max_distance if scheme == "capped" else None,
                                              compress_sliding=compress_sliding))
                if on_run is not None:
                    on_run(runs)
    return runs


def run_dict(run: StreamRun) -> dict:
    return {**asdict(run), "summary": run.summary()}
