"""The decode step on CPU through the native ops (kernels/native: the attention, decode_attend.cc, and the linear
layers, rows_linear.cc) and through torch's operators (``reference_decode.attend_decode``, BLAS), compiled and eager, in
one process:

    python benchmarks/decode_native.py --out docs/results/decode_native_cpu          # kvbound, batches 1,4,8
    python benchmarks/decode_native.py --model gemma3-270m --batches 1,8 --total 2048

Per batch: a request of ``--total`` tokens (half of them prompt, so the H2O cache holds budget x total slots);
four models built from the same weights (compiled / eager x native / torch operators), each prefilled with
the same prompt, then ``--rounds`` rounds of ``--steps`` decode steps, the four alternating, the median step per
model; the attention op alone at the first layer's shapes, both ways; and every linear layer of one step at the
batch's rows: ``rows_linear`` against torch's BLAS as ``W @ x^T`` (what the step ran before) and as ``x @ W^T``
(``F.linear``). The compiled torch-operator model is compiled under ``native_cpu.disabled()``, which is how the
step decides at compile time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

VARIANTS = ("compiled, native", "compiled, torch ops", "eager, native", "eager, torch ops")


def _build(model_name: str, budget: float):
    import h2o_compile
    from h2o_compile.bench.serve import load_model

    model = load_model(model_name, "cpu")
    return {v: h2o_compile.optimize(model, budget=budget, compile=v.startswith("compiled")) for v in VARIANTS}


def _native_off(variant: str):
    from contextlib import nullcontext

    from h2o_compile.kernels import native_cpu

    return native_cpu.disabled() if variant.endswith("torch ops") else nullcontext()


def time_steps(opts: dict, batch: int, total: int, steps: int, rounds: int) -> dict:
    """Median decode step (ms) per variant, the variants alternating round by round."""
    gen = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, next(iter(opts.values())).vocab_size, (batch, total // 2), generator=gen)
    token = prompt[:, -1:]
    for variant, opt in opts.items():
        with _native_off(variant):
            opt.reset(batch, total)
            opt.step(prompt)
            opt.step(token)  # compiles (the first batch) or warms
    times = {v: [] for v in opts}
    for _ in range(rounds):
        for variant, opt in opts.items():
            with _native_off(variant):
                for _ in range(steps):
                    start = time.perf_counter()
                    opt.step(token)
                    times[variant].append(time.perf_counter() - start)
    return {v: 1000 * statistics.median(t) for v, t in times.items()}


def time_attention(opt, batch: int, repeats: int = 200) -> dict:
    """The attention op alone (microseconds) at the first layer's shapes once the cache is full."""
    from h2o_compile.kernels import native_cpu, reference
    from h2o_compile.kernels import reference_decode
    from h2o_compile.graph.support import text_config

    key_cache, value_cache, _, pos_cache = opt.layer_states()[0][:4]
    b, hkv, cap, d = key_cache.shape
    hq = text_config(opt.model).num_attention_heads
    q, k, v = torch.randn(b, hq, 1, d), torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, value_cache.shape[3])
    valid, new_pos = torch.ones(b, 1, dtype=torch.bool), pos_cache.amax(dim=2, keepdim=True) + 1
    state = reference.make_state(key_cache, value_cache, None, pos_cache)
    calls = {"native": lambda: native_cpu.attend_decode(q, k, v, valid, key_cache, value_cache, pos_cache, d ** -0.5,
                                                        new_pos, 0, 0.0, None),
             "torch ops": lambda: reference_decode.attend_decode(q, k, v, valid, state, d ** -0.5, new_pos)}
    result = {}
    for name, fn in calls.items():
        for _ in range(10):
            fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        result[name] = 1e6 * (time.perf_counter() - start) / repeats
    result["shape"] = {"B": b, "Hq": hq, "Hkv": hkv, "C": cap, "D": d}
    return result


def time_linears(model, batch: int, repeats: int = 15) -> dict:
    """Every 2-D weight of ``model`` except the embedding times ``batch`` rows, three ways: milliseconds for the
    whole set (one decode step's linear layers), median of ``repeats``."""
    import torch.nn.functional as F

    from h2o_compile.kernels import native_cpu

    embedding = model.get_input_embeddings().weight
    weights = [p for p in model.parameters() if p.dim() == 2 and p is not embedding]
    if model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embedding:
        weights.append(embedding)  # a tied output projection is read by every step too
    rows = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
    forms = {"rows_linear": lambda w: native_cpu.rows_linear(rows[w.shape[1]], w),
             "W @ x^T": lambda w: w @ rows[w.shape[1]].t(),
             "x @ W^T": lambda w: F.linear(rows[w.shape[1]], w)}
    result = {}
    for name, form in forms.items():
        times = []
        for _ in range(repeats + 2):
            start = time.perf_counter()
            for w in weights:
                form(w)
            times.append(time.perf_counter() - start)
        result[name] = 1000 * statistics.median(times[2:])
    result["weight_mib"] = sum(w.numel() * w.element_size() for w in weights) / 2**20
    return result


def markdown(rows: list[dict], command: str, machine: str) -> str:
    lines = ["# The CPU decode step: through the native ops or torch's operators", "",
             f"Command: `{command}`  ", f"Machine: {machine}", "",
             "`step ms`: median decode step of a request of `total` tokens (half prompt) at H2O budget "
             f"{rows[0]['budget']}, the four variants alternating in one process (`native`: the attention and "
             "the linear layers through the native ops); `attention us`: the first layer's attention op alone "
             "at the same shapes; `linears ms`: one step's linear layers "
             f"({rows[0]['linears_ms']['weight_mib']:.0f} MiB of weights) at the batch's rows, three ways.", "",
             "| model | batch | request tokens | cache slots | " + " | ".join(f"{v} ms" for v in VARIANTS)
             + " | compiled gain | eager gain | attention us, native | attention us, torch ops"
             + " | linears ms, rows_linear | linears ms, W @ x^T | linears ms, x @ W^T |",
             "|---" * (11 + len(VARIANTS)) + "|"]
    for r in rows:
        s, a = r["step_ms"], r["attention_us"]
        lines.append(f"| {r['model']} | {r['batch']} | {r['total']} | {a['shape']['C']} | "
                     + " | ".join(f"{s[v]:.2f}" for v in VARIANTS)
                     + f" | {s['compiled, torch ops'] / s['compiled, native']:.2f}x"
                     + f" | {s['eager, torch ops'] / s['eager, native']:.2f}x"
                     + f" | {a['native']:.0f} | {a['torch ops']:.0f}"
                     + " | " + " | ".join(f"{r['linears_ms'][k]:.2f}" for k in ("rows_linear", "W @ x^T", "x @ W^T"))
                     + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import shlex
    import sys

    from h2o_compile.cli.arguments import csv_of
    from h2o_compile.kernels import native_cpu
    from h2o_compile.reporting import machine_description

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="kvbound", choices=("kvbound", "gemma3-270m", "smoke"))
    p.add_argument("--batches", type=csv_of(int), default=[1, 4, 8], help="comma-separated (1,4,8)")
    p.add_argument("--total", type=int, default=1280, help="prompt + new tokens of the timed request")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=20, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="folder for decode_native.json / .md")
    args = p.parse_args()
    batches = args.batches
    if min(batches + [args.total, args.steps, args.rounds, args.threads]) < 1:
        raise SystemExit("--batches, --total, --steps, --rounds and --threads must be >= 1")
    if 1 + args.steps * args.rounds > args.total - args.total // 2:
        raise SystemExit(f"--steps x --rounds = {args.steps * args.rounds} decode steps do not fit in the second half "
                         f"of --total {args.total}")
    if not native_cpu.available():
        raise SystemExit("the native CPU ops could not be built here; nothing to compare")
    torch.set_num_threads(args.threads)
    opts = _build(args.model, args.budget)
    rows = []
    with torch.no_grad():
        for batch in batches:
            steps = time_steps(opts, batch, args.total, args.steps, args.rounds)
            attention = time_attention(opts["eager, native"], batch)
            linears = time_linears(opts["eager, native"].model, batch)
            rows.append({"model": args.model, "batch": batch, "total": args.total, "budget": args.budget,
                         "step_ms": steps, "attention_us": attention, "linears_ms": linears})
            print(json.dumps(rows[-1]), flush=True)
    command = "python benchmarks/decode_native.py " + shlex.join(sys.argv[1:])
    report = markdown(rows, command, machine_description())
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_native.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
        (out / "decode_native.md").write_text(report)


if __name__ == "__main__":
    main()
