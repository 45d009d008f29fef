"""What the position schemes of a stream cost per step: rolling (rank), capped (true distance up to D) and true.

Rank numbering builds rotary tables of C + T rows per forward; capped distances max(D + 1, T) rows (16,385 at
Gemma 3's default D = 16,384), evaluated by the model's own rotary subgraph at every forward. This measures
that cost where a stream pays it: one step of T tokens after the cache is full, alternating the schemes in
one process, median of ``--repeats``. Eager by default (how streams and CPU generate run); ``--compile`` times
the compiled decode step instead (T = 1 only: the step torch.compile serves).

    python research/positions_cost.py --model gemma3-270m --budget-slots 1024 --tokens 1,128 \\
        --out docs/results/stream/positions_cost
    python research/positions_cost.py --model gemma3-270m --budget-slots 1024 --tokens 1 --compile \\
        --out docs/results/stream/positions_cost_compiled

Writes positions_cost.json and .md (command and machine included).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

import h2o_compile
from h2o_compile.reporting import command_line, machine_description, markdown_table, write_json
from h2o_compile.zoo.loading import load_pretrained

SCHEMES = ("rolling", "capped", "true")


def filled(model, scheme: str, slots: int, vocab: int, compile: bool) -> h2o_compile.H2OModel:
    """A stream of ``slots`` + 256 tokens already fed (every slot taken, eviction running)."""
    opt = h2o_compile.optimize(model, budget=slots, policy="h2o", positions=scheme, prefill=128, compile=compile)
    opt.reset(1, capacity=slots)
    ids = torch.randint(0, vocab, (1, slots + 256), generator=torch.Generator().manual_seed(0))
    opt.step(ids)
    return opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--budget-slots", type=int, default=1024)
    parser.add_argument("--tokens", default="1,128", help="comma-separated block sizes T")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compile", action="store_true", help="time the compiled decode step (--tokens 1)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    blocks = [int(t) for t in args.tokens.split(",")]
    if args.compile and blocks != [1]:
        raise ValueError(f"--compile times the decode step: give --tokens 1, not {args.tokens}")
    model, _ = load_pretrained(args.model)
    vocab = model.config.vocab_size
    runners = {scheme: filled(model, scheme, args.budget_slots, vocab, args.compile) for scheme in SCHEMES}
    times = {(scheme, t): [] for scheme in SCHEMES for t in blocks}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in tqdm(range(args.repeats + 1), desc="rounds"):
            for t in blocks:
                ids = torch.randint(0, vocab, (1, t), generator=gen)
                for scheme, opt in runners.items():  # alternating: drift hits every scheme alike
                    start = time.perf_counter()
                    opt.step(ids)
                    times[scheme, t].append(time.perf_counter() - start)
    rows, records = [], []
    for t in blocks:
        base = statistics.median(times["rolling", t][1:])  # the first round warms up
        for scheme in SCHEMES:
            median = statistics.median(times[scheme, t][1:])
            records.append({"positions": scheme, "tokens": t, "median_s": median, "vs_rolling": median / base})
            rows.append((scheme, t, f"{median * 1e3:.1f}", f"{median / base:.2f}x"))
    caps = {scheme: opt.h2o_config.position_cap(opt.limits.max_positions) for scheme, opt in runners.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = {"command": command_line(), "machine": machine_description(), "model": args.model,
              "budget_slots": args.budget_slots, "repeats": args.repeats, "max_distance": caps["capped"],
              "compiled": args.compile}
    write_json(out / "positions_cost.json", {**header, "results": records})
    table = markdown_table(["positions", "block T", "median step (ms)", "vs rolling"], rows)
    (out / "positions_cost.md").write_text(
        f"# Step time by position scheme: {args.model}\n\nCommand: `{header['command']}`  \n"
        f"Machine: {header['machine']}\n\nOne {'compiled' if args.compile else 'eager'} step of T tokens "
        f"through {args.budget_slots} slots after "
        f"{args.budget_slots + 256} tokens, h2o, the schemes alternating in one process, median of "
        f"{args.repeats} (after one warm-up round). Capped at {caps['capped']:,}.\n\n{table}\n")
    print((out / "positions_cost.md").read_text())


if __name__ == "__main__":
    main()
