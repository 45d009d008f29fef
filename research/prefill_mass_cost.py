"""What the key mass costs in one prompt's attention on CPU: torch's fused causal flash attention alone, the
project's prefill (kernels/cpu_prefill.py) without the mass, with it through the native one-pass op
(kernels/native_cpu.py) and through the two-pass path, and the two-pass path's own operators.

The paper's rule reads every prompt query's attention, which torch's fused kernel never materializes: the
two-pass path runs a second q.k product per chunk of queries (exp, column sums) after it, the one-pass op keeps
each query tile's probabilities in cache for both the output and the column sums. This script puts a number on
both for one layer's shapes (the KV-bound model: 8 heads of 64, no GQA):

    python research/prefill_mass_cost.py                       # T = 4080, batch 1, 8 heads of 64
    python research/prefill_mass_cost.py --length 1024 --batch 8 --out /tmp/mass.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from h2o_compile.reporting import machine_description
from h2o_compile.kernels import cpu_prefill, native_cpu


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=4080)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = p.parse_args()
    if min(args.length, args.batch, args.heads, args.head_dim, args.repeats) < 1:
        raise SystemExit("--length, --batch, --heads, --head-dim and --repeats must be >= 1")

    torch.manual_seed(0)
    b, h, t, d = args.batch, args.heads, args.length, args.head_dim
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))
    key_pos = torch.arange(t).expand(b, h, t).contiguous()
    query_pos = torch.arange(t).expand(b, t)
    valid = torch.ones(b, t, dtype=torch.bool)
    scale = d ** -0.5
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def prefill(need_mass: bool):
        return cpu_prefill.attend_sdpa(q, k, v, key_pos, query_pos, valid, scale, new_from=0, need_mass=need_mass)

    if not native_cpu.available():
        raise SystemExit("the native one-pass op could not be built here (see the warning above)")
    figures = {
        "flash_causal_s": median_seconds(lambda: flash(q, k, v, 0.0, True, scale=scale), args.repeats),
        "attend_without_mass_s": median_seconds(lambda: prefill(False), args.repeats),
        "attend_with_mass_one_pass_s": median_seconds(lambda: prefill(True), args.repeats),
    }
    with native_cpu.disabled():
        figures["attend_with_mass_two_pass_s"] = median_seconds(lambda: prefill(True), args.repeats)
        with torch.profiler.profile() as prof:
            prefill(True)
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    figures["operators_s"] = {name: ops.get(name, 0.0)
                              for name in ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm",
                                           "aten::exp_", "aten::sum", "aten::masked_fill_", "aten::cat")}
    for path in ("one_pass", "two_pass"):
        figures[f"mass_over_flash_{path}"] = (figures[f"attend_with_mass_{path}_s"]
                                              - figures["attend_without_mass_s"]) / figures["flash_causal_s"]

    print(f"{machine_description()}; batch {b}, {h} heads of {d}, {t} tokens, median of {args.repeats}")
    for name in ("flash_causal_s", "attend_without_mass_s", "attend_with_mass_one_pass_s",
                 "attend_with_mass_two_pass_s"):
        print(f"  {name:<30} {figures[name] * 1e3:8.1f} ms")
    print(f"  the mass costs {figures['mass_over_flash_one_pass']:.2f}x the fused attention in one pass, "
          f"{figures['mass_over_flash_two_pass']:.2f}x in two; the two-pass operators (one call):")
    for name, seconds in figures["operators_s"].items():
        print(f"    {name:<52} {seconds * 1e3:8.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "machine": machine_description(), **figures}, f, indent=1)


if __name__ == "__main__":
    main()
