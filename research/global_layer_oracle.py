"""How well could any eviction rule do on a hybrid model's full-attention layers? An oracle that knows the future.

With the default per-layer settings a sliding-window layer keeps its window and only the full-attention
layers evict, so perplexity at a budget is decided by which C keys those few layers keep. This probe bounds
what a better score rule could gain there: it replays teacher-forced perplexity (the measurement of
``h2o-compile eval``: a prompt block of P tokens, then one token at a time) as one forward pass of the
transformers model in which each full-attention layer sees, for query t, exactly the keys an eviction process
would hold at t (the keys are computed at their true positions and never change once cached, so a mask per
layer replays the process exactly; the sliding layers keep transformers' own window mask).

Eviction processes (each full-attention layer holds at most C keys; query t sees the kept keys and itself,
then the cache is cut back to C, as docs/design.md section 2 orders a decode step):

    full        no eviction (must reproduce the library's full-cache perplexity)
    sink        4 sink tokens, then oldest first (must reproduce the library's ``sink`` policy)
    local       oldest first
    lookahead=K the oracle reading only the next K queries
    h2o, mean   the accumulated attention (sum, or / lifetime), from the full run's probabilities
                renormalised over the keys each query saw (reproduces the library's rule up to the drift
                of the hidden states the eviction causes)
    decay=G     the same with a decay G per query
    max=G       a key's largest probability from one query, decayed by G per query
    count=G     the decayed count of queries that gave the key more than the uniform share (Scissorhands)
    oracle      evict the key that the *remaining* queries of the full-cache run attend to least
                (sum over the layer's query heads of their attention probabilities from t+1 to the end);
                a rule that reads only the past cannot know this, so it marks how far the future-blind
                rules are from what a good choice of C keys could give (not a proof of optimality:
                the attention with the kept keys differs from the full cache's)

    python research/global_layer_oracle.py --text ../shared/data/wikitext-2/test.txt --tail 0.5 \
        --capacities 205,308,410 --out docs/results/eval_gemma3/probes/global_oracle

Results: docs/results/eval_gemma3/probes/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

SINKS = 4


def visible_keys(length: int, capacity: int, prompt_len: int, process, recent: int = 0) -> torch.Tensor:
    """BoolTensor [T, T]: row t = the keys query t attends to under the eviction process.

    ``process.observe(t, keys)`` is told the keys query t saw; ``process.priority(t, keys)`` -> FloatTensor
    [len(keys)] ranks the kept ``keys`` (LongTensor) after query t: the lowest goes first (ties: the older).
    The newest ``recent`` keys are never evicted."""
    seen = torch.zeros(length, length, dtype=torch.bool)
    seen[:prompt_len, :prompt_len] = torch.ones(prompt_len, prompt_len, dtype=torch.bool).tril()
    for t in range(prompt_len):
        process.observe(t, torch.arange(t + 1))
    kept = torch.arange(prompt_len)
    for t in range(prompt_len - 1, length):
        if t >= prompt_len:
            kept = torch.cat([kept, torch.tensor([t])])
            seen[t, kept] = True
            process.observe(t, kept)
        excess = len(kept) - capacity
        if excess > 0:
            rank = process.priority(t, kept).double()
            rank[kept > t - recent] = math.inf
            order = torch.argsort(rank, stable=True)  # kept is in position order: a stable sort evicts older first
            drop = torch.zeros(len(kept), dtype=torch.bool)
            drop[order[:excess]] = True
            kept = kept[~drop]
    return seen


class Fixed:
    """A process whose priority needs no history: ``rank(t, keys)``."""

    def __init__(self, rank):
        self.rank = rank

    def observe(self, t, keys):
        pass

    def priority(self, t, keys):
        return self.rank(t, keys)


class Scored:
    """A score per key from the full run's probabilities of each query, renormalised over the keys it saw (what
    the attention over the kept keys gives, up to the drift of the hidden states), decayed by g per query:

        "sum"    A = g A + P_t (H2O's accumulated attention; ``mean`` divides it by the key's lifetime)
        "max"    A = max(g A, P_t) (a key's decayed peak)
        "count"  A = g A + [P_t > 1 / keys seen] (Scissorhands' persistence of importance)
    """

    def __init__(self, probs: torch.Tensor, decay: float = 1.0, update: str = "sum", mean: bool = False):
        self.probs, self.decay, self.update, self.mean = probs, decay, update, mean
        self.score = torch.zeros(probs.shape[1], dtype=torch.float64)

    def observe(self, t, keys):
        row = self.probs[t, keys]
        row = row / row.sum()
        self.score *= self.decay
        if self.update == "max":
            self.score[keys] = torch.maximum(self.score[keys], row)
        else:
            self.score[keys] += (row * len(keys) > 1).double() if self.update == "count" else row

    def priority(self, t, keys):
        return self.score[keys] / (t - keys + 1) if self.mean else self.score[keys]


PROCESSES = "full, sink, local, oracle, lookahead=K, h2o, mean, decay=G, max=G, count=G"


def parse_process(name: str) -> tuple[str, float]:
    """``name`` -> (kind, its number: K of lookahead, G of a decay; 0 without one); a ValueError names a bad one."""
    if name in ("full", "local", "sink", "oracle", "h2o", "mean"):
        return name, 0.0
    kind, _, value = name.partition("=")
    if kind == "lookahead" and value.isdigit() and int(value) > 0:
        return kind, int(value)
    if kind in ("decay", "max", "count"):
        try:
            decay = float(value)
        except ValueError:
            decay = -1.0
        if 0.0 <= decay <= 1.0:
            return kind, decay
    raise ValueError(f"process {name!r}; allowed: {PROCESSES} (K an int >= 1, G in [0, 1])")


def make_process(name: str, probs: torch.Tensor, future_mass: torch.Tensor):
    """Process ``name`` (not ``full``) for one layer; ``probs`` [T, T] its full-cache attention (query heads
    summed), ``future_mass`` [T + 1, T]: row t = the mass of queries >= t."""
    kind, value = parse_process(name)
    if kind == "local":
        return Fixed(lambda t, keys: keys.double())
    if kind == "sink":
        return Fixed(lambda t, keys: torch.where(keys < SINKS, math.inf, keys.double()))
    if kind == "oracle":
        return Fixed(lambda t, keys: future_mass[t + 1, keys])
    if kind == "lookahead":
        return Fixed(lambda t, keys: future_mass[t + 1, keys] - future_mass[min(t + 1 + value, len(probs)), keys])
    if kind in ("h2o", "mean"):
        return Scored(probs, mean=kind == "mean")
    if kind in ("decay", "max", "count"):
        return Scored(probs, value, update="sum" if kind == "decay" else kind)
    raise ValueError(f"process {name!r} has no eviction to replay")


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, prompt_len: int, masks: dict) -> float:
    """Sum of NLL over tokens prompt_len..T-1 of ``ids`` [T]; ``masks``: layer index -> BoolTensor [T, T]."""
    handles = []
    for index, seen in masks.items():
        additive = torch.zeros(seen.shape).masked_fill(~seen, -math.inf)[None, None]

        def swap_mask(module, args, kwargs, additive=additive):
            return args, {**kwargs, "attention_mask": additive}

        attn = model.model.layers[index].self_attn
        handles.append(attn.register_forward_pre_hook(swap_mask, with_kwargs=True))
    try:
        logits = model(ids[None]).logits[0, prompt_len - 1:-1].float()
    finally:
        for handle in handles:
            handle.remove()
    return torch.nn.functional.cross_entropy(logits, ids[prompt_len:], reduction="sum").item()


@torch.no_grad()
def full_attention_mass(model, ids: torch.Tensor, layers) -> dict:
    """Layer index -> (probabilities [T, T], future mass [T + 1, T]: row t = the mass key p gets from queries
    t..), query heads summed, in the full-cache run."""
    probs, handles = {}, []
    for index in layers:
        def keep(module, args, output, index=index):
            probs[index] = output[1][0].sum(0)          # [T, T]: query heads summed (one KV head per group)
        handles.append(model.model.layers[index].self_attn.register_forward_hook(keep))
    try:
        model(ids[None])
    finally:
        for handle in handles:
            handle.remove()
    return {index: (p.double(), torch.cat([p.double().flip(0).cumsum(0).flip(0),
                                           torch.zeros(1, p.shape[1], dtype=torch.float64)]))
            for index, p in probs.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--text", required=True)
    parser.add_argument("--tail", type=float, default=0.5)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--capacities", default="205", help="slots per full-attention layer, comma-separated")
    parser.add_argument("--processes", default="full,sink,local,oracle")
    parser.add_argument("--recent", type=int, default=0, help="newest keys the score-based processes never evict")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    names = args.processes.split(",")
    for name in names:  # a bad name fails here, not after the model and the first window
        try:
            parse_process(name)
        except ValueError as error:
            parser.error(f"--processes: {error}")
    try:
        capacities = [int(c) for c in args.capacities.split(",")]
    except ValueError:
        parser.error(f"--capacities {args.capacities!r}: comma-separated ints >= 1")
    if min(capacities) < 1:
        parser.error(f"--capacities {args.capacities!r}: comma-separated ints >= 1")

    from h2o_compile.quality.evaluation import read_tail, token_windows
    from h2o_compile.zoo.loading import load_pretrained

    model, tokenizer = load_pretrained(args.model)
    model.set_attn_implementation("eager")          # the hooks read each layer's attention probabilities
    full_layers = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    seqs = token_windows(tokenizer, [read_tail(args.text, args.tail)], args.seq_len, args.num_seqs)
    configs = [("full", None)] if "full" in names else []
    configs += [(name, c) for name in names if name != "full" for c in capacities]
    nll = {config: 0.0 for config in configs}
    start = time.perf_counter()
    for ids in tqdm(seqs, desc="windows"):
        mass = full_attention_mass(model, ids, full_layers)
        for name, capacity in configs:
            if name == "full":
                masks = {}
            else:
                recent = 0 if name in ("sink", "local") else args.recent
                masks = {i: visible_keys(len(ids), capacity, args.prompt_len, make_process(name, *mass[i]), recent)
                         for i in full_layers}
            nll[(name, capacity)] += window_nll(model, ids, args.prompt_len, masks)
    tokens = len(seqs) * (args.seq_len - args.prompt_len)
    rows = [{"process": name, "capacity": capacity, "perplexity": math.exp(total / tokens)}
            for (name, capacity), total in nll.items()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": "python research/global_layer_oracle.py " + " ".join(argv or sys.argv[1:]),
              "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
                         f"{torch.get_num_threads()} threads", "full_attention_layers": full_layers,
              "windows": len(seqs), "tokens_scored": tokens, "recent": args.recent,
              "elapsed_s": round(time.perf_counter() - start, 1), "rows": rows}
    (out / "oracle.json").write_text(json.dumps(report, indent=2))
    for row in rows:
        print(f"{row['process']:>7} C={row['capacity']}: {row['perplexity']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
