"""The eager CPU decode step with its linear layers as ``aten.linear`` vs ``weight @ x^T``
(passes/weight_major_linear.py), same process, alternating, on the kvbound model's H2O cache (budget 0.2):
the measurement behind H2OModel's eager step taking the rewrite from two rows on.

    python research/eager_decode_layout.py --out docs/results/eager_decode_layout_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from h2o_compile.cli.arguments import csv_of
from h2o_compile.bench.contenders import H2OContender
from h2o_compile.bench.decode import _timed_block, build_model
from h2o_compile.graph.passes import weight_major_linears
from h2o_compile.graph.passes.h2o_attention import copy_graph_module
from h2o_compile.reporting import machine_description


def step_ms(batch: int, total: int, context: int, steps: int, repeats: int, model) -> dict:
    """Median eager step time (ms) at ``batch`` rows, per form: the best of ``repeats`` alternating blocks of
    ``steps`` steps, each block's median."""
    contender = H2OContender(model, "h2o", 0.2, compile=False)
    plain = contender.h2o.graph
    rewritten = copy_graph_module(plain)
    weight_major_linears(rewritten)
    contender.prepare(batch, total, context, seed=0)
    tokens = torch.randint(0, model.config.vocab_size, (batch, steps), generator=torch.Generator().manual_seed(0))
    medians = {"aten_linear": [], "weight_major": []}
    for rep in range(repeats + 1):  # the first round warms up, untimed
        for form, graph in (("aten_linear", plain), ("weight_major", rewritten)):
            # Every row count through this graph (H2OModel itself picks by batch size).
            contender.h2o.graph = contender.h2o._eager_step_graph = graph
            times, _ = _timed_block(contender, tokens, context)
            contender.restore()
            if rep:
                medians[form].append(statistics.median(times) * 1e3)
    return {form: min(values) for form, values in medians.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=csv_of(int), default=[1, 2, 4, 8], help="comma-separated (1,2,4,8)")
    p.add_argument("--total", type=int, default=1200, help="max_seq_len the cache is sized for")
    p.add_argument("--context", type=int, default=700, help="tokens already in the cache")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = p.parse_args()
    batches = args.batches
    if min(batches + [args.steps, args.repeats]) < 1 or not 0 < args.context < args.total - args.steps:
        raise SystemExit("--batches, --steps, --repeats must be >= 1 and 0 < --context < --total - --steps")
    torch.set_num_threads(2)
    model = build_model("kvbound")
    rows = []
    for batch in batches:
        ms = step_ms(batch, args.total, args.context, args.steps, args.repeats, model)
        rows.append({"batch": batch, **ms, "speedup": ms["aten_linear"] / ms["weight_major"]})
        print(f"batch {batch}: aten.linear {ms['aten_linear']:.2f} ms, weight @ x^T {ms['weight_major']:.2f} ms "
              f"({rows[-1]['speedup']:.2f}x)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_description(), "settings": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
