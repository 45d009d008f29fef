"""Decode-step microbenchmark: the fused Triton H2O decode vs the reference op vs SDPA.

Contenders, one new token per row against a Llama-7B-like GQA head config (32 query / 8 KV heads, D = 128):
  triton       triton_ops.h2o_attention_ over C = ceil(budget * context) slots (the kernel's attention and
               per-key mass, then the shared torch bookkeeping: scores, eviction and the slot write)
  reference    reference_decode.h2o_decode_ over the same C slots (plain PyTorch, the executable spec)
  sdpa_budget  F.scaled_dot_product_attention over the C slots (attention only: the speed of light for C)
  sdpa_full    F.scaled_dot_product_attention over the whole context (what a full cache costs)

On CUDA each contender's step is captured in a CUDA graph (as the runtime runs decode) and also timed eagerly;
several input sets are rotated so that repeated steps do not just re-read L2. Times are medians of CUDA-event
samples after a warm-up. `--device cpu --quick` runs the reference and SDPA contenders on tiny shapes, to
check the script itself without a GPU. Results go to $OUT/decode_kernel_micro.json (OUT defaults to ./out).

    python benchmarks/decode_kernel_micro.py                       # GPU: contexts 1k/4k/8k, batch 1 and 8
    python benchmarks/decode_kernel_micro.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from h2o_compile.kernels import reference
from h2o_compile.kernels import reference_decode

HQ, HKV, D = 32, 8, 128
L2_BYTES = 200 * 2**20  # rotate input sets until this much is touched: well past any GPU's L2


def make_sets(n_sets, batch, context, cap, dtype, device, seed=0):
    """Per set: the new token's q/k/v, a full H2O state of `cap` slots, and a full cache of `context` keys."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    sets = []
    for _ in range(n_sets):
        state = reference.empty_state(batch, HKV, cap, D, dtype=dtype, device=device)
        state.key_cache.copy_(rand(batch, HKV, cap, D))
        state.value_cache.copy_(rand(batch, HKV, cap, D))
        state.score_cache.copy_(torch.rand(batch, HKV, cap, generator=gen).to(device) * 4)
        # Kept positions: a random choice of old tokens plus the recent window, as after many steps of H2O.
        kept = torch.randperm(context - 1, generator=gen)[:cap].sort().values
        state.pos_cache.copy_(kept.to(device).expand(batch, HKV, cap))
        sets.append(dict(
            q=rand(batch, HQ, 1, D), k=rand(batch, HKV, 1, D), v=rand(batch, HKV, 1, D),
            positions=torch.full((batch, 1), context - 1, device=device, dtype=torch.int64),
            state=state, full_k=rand(batch, HKV, context, D), full_v=rand(batch, HKV, context, D)))
    return sets


def contenders(cap, recent, with_triton):
    scale = D ** -0.5
    steps = {
        "reference": lambda s: reference_decode.h2o_decode_(s["q"], s["k"], s["v"], s["positions"], None, s["state"],
                                                     scale=scale, recent=recent, sinks=0, policy="h2o"),
        "sdpa_budget": lambda s: F.scaled_dot_product_attention(s["q"], s["state"].key_cache,
                                                                s["state"].value_cache, enable_gqa=True),
        "sdpa_full": lambda s: F.scaled_dot_product_attention(s["q"], s["full_k"], s["full_v"],
                                                              enable_gqa=True),
    }
    if with_triton:
        from h2o_compile.kernels import triton_ops

        steps = {"triton": lambda s: triton_ops.h2o_attention_(s["q"], s["k"], s["v"], s["positions"], None,
                                                              s["state"], scale=scale, recent=recent, sinks=0,
                                                              policy="h2o"), **steps}
    return steps


def time_cuda(step, sets, samples, reps, graph):
    """Median microseconds per step; each sample runs `reps` passes over every input set."""
    def run_all():
        for s in sets:
            step(s)

    for _ in range(3):  # warm-up: Triton compilation, cuBLAS / SDPA handles
        run_all()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run_all()  # warm-up on the side stream, as capture requires
            with torch.cuda.graph(g, stream=stream):
                run_all()
        torch.cuda.current_stream().wait_stream(stream)
        run_all = g.replay
        for _ in range(3):
            run_all()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            run_all()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * len(sets)))
    return times


def time_cpu(step, sets, samples, reps):
    for s in sets:
        step(s)
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            for s in sets:
                step(s)
        times.append((time.perf_counter() - t0) * 1e6 / (reps * len(sets)))
    return times


def check_triton(cap, recent, sets):
    """Correct first: the kernel and the reference from the same state give the same slots and outputs."""
    from h2o_compile.kernels import triton_ops

    s = sets[0]
    a = reference.H2OState(*(x.clone() for x in s["state"]))
    b = reference.H2OState(*(x.clone() for x in s["state"]))
    kw = dict(scale=D ** -0.5, recent=recent, sinks=0, policy="h2o")
    want = reference_decode.h2o_decode_(s["q"], s["k"], s["v"], s["positions"], None, a, **kw)
    got = triton_ops.h2o_attention_(s["q"], s["k"], s["v"], s["positions"], None, b, **kw)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    return dict(out_rel_err=rel, same_slots=bool(torch.equal(a.pos_cache, b.pos_cache)),
                score_max_err=(a.score_cache - b.score_cache).abs().max().item())


def measure(dtype_name, batch, context, args, device):
    """Every contender at one (dtype, batch, context); returns (result rows, correctness check or None)."""
    cuda = device.type == "cuda"
    dtype = getattr(torch, dtype_name)
    cap = math.ceil(args.budget * context)
    recent = max(1, round(cap * 0.5))
    per_set = 2 * batch * HKV * (cap + context) * D * dtype.itemsize
    n_sets = max(1, min(8, math.ceil(L2_BYTES / per_set))) if cuda else 1
    sets = make_sets(n_sets, batch, context, cap, dtype, device)
    check = None
    if cuda:  # on CPU the kernels only run under the interpreter: no timing worth reporting
        check = dict(dtype=dtype_name, batch=batch, context=context, **check_triton(cap, recent, sets))
    rows = []
    for name, step in contenders(cap, recent, with_triton=cuda).items():
        for mode in (["graph", "eager"] if cuda else ["eager"]):
            row = dict(contender=name, mode=mode, dtype=dtype_name, batch=batch, context=context,
                       capacity=cap, n_sets=n_sets)
            try:
                if cuda:
                    times = time_cuda(step, sets, args.samples, 5 if args.quick else 20, mode == "graph")
                else:
                    times = time_cpu(step, sets, args.samples, 3)
            except Exception as exc:  # noqa: BLE001  (reported in the JSON, not fatal)
                rows.append(dict(row, error=repr(exc)[:300]))
                continue
            rows.append(dict(row, median_us=statistics.median(times), min_us=min(times), max_us=max(times)))
    return rows, check


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few samples (script check)")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtypes", nargs="+", default=None,
                   help="default: float16 bfloat16 (CUDA), float32 (CPU)")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--out", default=os.environ.get("OUT", "./out"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.quick:
        args.contexts, args.batches, args.samples = [256, 512], [1, 2], 5
    dtypes = args.dtypes or (["float16", "bfloat16"] if cuda else ["float32"])

    results, checks = [], []
    for dtype_name in dtypes:
        for batch in args.batches:
            for context in args.contexts:
                rows, check = measure(dtype_name, batch, context, args, device)
                results += rows
                checks += [check] if check else []
    summary = summarize(results)
    report = dict(
        env=dict(torch=torch.__version__, python=platform.python_version(), device=str(device),
                 device_name=torch.cuda.get_device_name(device) if cuda else platform.processor(),
                 triton=_triton_version()),
        config=dict(hq=HQ, hkv=HKV, head_dim=D, budget=args.budget, samples=args.samples, quick=args.quick),
        checks=checks, results=results, summary=summary,
        targets="triton <= 1.3 x sdpa_budget; sdpa_full / triton >= 3 at context 8192 (graph mode)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_kernel_micro.json").write_text(json.dumps(report, indent=2))
    for c in checks:
        print("check", c)
    print_table(summary)
    print(f"wrote {out / 'decode_kernel_micro.json'} (times in microseconds per decode step)")
    return report


def print_table(summary):
    nan = float("nan")
    print(f"{'dtype':9} {'B':>2} {'ctx':>5} {'C':>5} {'mode':5} " + " ".join(f"{n:>11}" for n in _NAMES)
          + "  tri/sdpaC  full/tri")
    for row in summary:
        cells = " ".join(f"{row.get(n, nan):11.1f}" for n in _NAMES)
        ratios = (f"{row.get('triton_over_sdpa_budget', nan):9.2f} "
                  f"{row.get('sdpa_full_over_triton', nan):9.2f}")
        print(f"{row['dtype']:9} {row['batch']:>2} {row['context']:>5} {row['capacity']:>5} {row['mode']:5} "
              f"{cells}  {ratios}")


_NAMES = ["triton", "reference", "sdpa_budget", "sdpa_full"]


def summarize(results):
    rows = {}
    for r in results:
        if "median_us" not in r:
            continue
        key = (r["dtype"], r["batch"], r["context"], r["mode"])
        row = rows.setdefault(key, dict(dtype=r["dtype"], batch=r["batch"], context=r["context"],
                                        capacity=r["capacity"], mode=r["mode"]))
        row[r["contender"]] = r["median_us"]
    for row in rows.values():
        if "triton" in row and "sdpa_budget" in row:
            row["triton_over_sdpa_budget"] = row["triton"] / row["sdpa_budget"]
        if "triton" in row and "sdpa_full" in row:
            row["sdpa_full_over_triton"] = row["sdpa_full"] / row["triton"]
    return list(rows.values())


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
