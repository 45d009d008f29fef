"""How fast this CPU streams a decode step's weights through each form of the same product: a few rows times 60
weight matrices of [out, in] (more bytes than the caches hold, as a model's layers), as ``aten.linear`` /
``mm(x, W.t())`` (how linear layers are called) and as ``W @ x.t()`` (passes/weight_major_linear.py), against a
plain sum over the same bytes. The measurement behind the weight-major rewrite of the compiled CPU decode step:

    python research/linear_layout.py --out docs/results/linear_layout_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from h2o_compile.cli.arguments import csv_of
from h2o_compile.graph.passes import linear_weight_major
from h2o_compile.reporting import machine_description


# The same product x [rows, in] times W [out, in]^T, by form.
FORMS = {"linear": lambda x, w: F.linear(x, w), "mm_x_wt": lambda x, w: torch.mm(x, w.t()),
         "mm_w_xt": lambda x, w: torch.mm(w, x.t()), "linear_weight_major": linear_weight_major}


def gb_per_s(fn, x, weights, repeats: int) -> float:
    """Weight bytes read per second by ``fn(x, w)`` over every weight, median of ``repeats`` sweeps after 2
    warm-ups."""
    total = sum(w.numel() * w.element_size() for w in weights)
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return total / statistics.median(times) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=csv_of(int), default=[1, 2, 8], help="comma-separated rows (the decode batch)")
    p.add_argument("--out-features", type=int, default=1024)
    p.add_argument("--in-features", type=int, default=512)
    p.add_argument("--matrices", type=int, default=60)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = p.parse_args()
    rows_list = args.rows
    if min(rows_list + [args.out_features, args.in_features, args.matrices, args.repeats]) < 1:
        raise SystemExit("--rows, --out-features, --in-features, --matrices and --repeats must be >= 1")

    torch.manual_seed(0)
    weights = [torch.randn(args.out_features, args.in_features) for _ in range(args.matrices)]
    figures = {"sum_gb_s": gb_per_s(lambda x, w: w.sum(), None, weights, args.repeats), "rows": {}}
    for rows in rows_list:
        x = torch.randn(rows, args.in_features)
        figures["rows"][rows] = {f"{name}_gb_s": gb_per_s(fn, x, weights, args.repeats) for name, fn in FORMS.items()}
    print(f"{machine_description()}; {args.matrices} weights of {args.out_features} x {args.in_features}, "
          f"median of {args.repeats}")
    print(f"  plain sum over the weights: {figures['sum_gb_s']:.1f} GB/s")
    for rows, row in figures["rows"].items():
        print(f"  {rows} rows: " + ", ".join(f"{k[:-5]} {v:.1f} GB/s" for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "machine": machine_description(), **figures}, f, indent=1)


if __name__ == "__main__":
    main()
