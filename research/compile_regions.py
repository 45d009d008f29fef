"""The compiled CPU decode step, compiled whole or one decoder layer at a time (``regional_compile=True``): the
cold compile in fresh processes, and the step time after it in one process, both variants side by side:

    python research/compile_regions.py --models kvbound,gemma3-270m --out docs/results/compile_regions_cpu

Cold: per model and variant (alternating, ``--repeats`` times), a fresh process with an empty Inductor cache
times its first decode step (Dynamo + Inductor + the C++ compiler; the prompt's eager prefill excluded) and
counts the graphs Dynamo compiled. Steps: one process compiles both variants, then times ``--rounds`` rounds of
``--steps`` decode steps each, alternating the variants, per batch size (a request of ``--total`` tokens, half
of them prompt); the median step per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"whole": False, "by-layer": True}
MODELS = ("kvbound", "gemma3-270m", "smoke")


def _models(model_name: str, variants) -> dict:
    import h2o_compile
    from h2o_compile.bench.serve import load_model

    model = load_model(model_name, "cpu")
    return {v: h2o_compile.optimize(model, budget=0.2, compile=True, regional_compile=VARIANTS[v]) for v in variants}


def _start_request(opt, batch: int, total: int):
    import torch

    gen = torch.Generator().manual_seed(batch)
    opt.reset(batch, total)
    opt.step(torch.randint(0, opt.vocab_size, (batch, total // 2), generator=gen))  # the prompt: eager prefill
    return torch.randint(0, opt.vocab_size, (batch, 1), generator=gen)


def cold(model_name: str, variant: str, batch: int, total: int) -> dict:
    """In a fresh process (the parent gives it an empty Inductor cache): the first decode step."""
    import torch
    from torch._dynamo.utils import counters

    opt = _models(model_name, [variant])[variant]
    with torch.no_grad():
        token = _start_request(opt, batch, total)
        start = time.perf_counter()
        opt.step(token)
        first = time.perf_counter() - start
    return {"model": model_name, "variant": variant, "first_step_s": first,
            "graphs": counters["stats"]["unique_graphs"]}


def steps(model_name: str, batches: list[int], total: int, steps_per_round: int, rounds: int) -> dict:
    """Both variants in one process, alternating rounds: the median decode step per variant and batch."""
    import torch

    opts = _models(model_name, VARIANTS)
    result = {"model": model_name, "step_ms": {v: {} for v in VARIANTS}}
    with torch.no_grad():
        for batch in batches:
            tokens = {v: _start_request(opt, batch, total) for v, opt in opts.items()}
            for v, opt in opts.items():
                opt.step(tokens[v])  # compiles (the first batch) or warms
            times = {v: [] for v in opts}
            for _ in range(rounds):
                for v, opt in opts.items():
                    for _ in range(steps_per_round):
                        start = time.perf_counter()
                        opt.step(tokens[v])
                        times[v].append(time.perf_counter() - start)
            for v in opts:
                result["step_ms"][v][str(batch)] = 1000 * statistics.median(times[v])
    return result


def run_child(args, *child_args: str, fresh_cache: bool) -> dict:
    """This script's ``--child`` in a new interpreter; ``fresh_cache``: with an Inductor cache of its own, so
    every compile is cold."""
    with tempfile.TemporaryDirectory(prefix="h2o_inductor_") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache) if fresh_cache else None
        out = subprocess.run([sys.executable, __file__, "--child", *child_args, "--batches", args.batches,
                              "--total", str(args.total), "--steps", str(args.steps), "--rounds", str(args.rounds),
                              "--threads", str(args.threads)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(child_args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(cold_rows: list[dict], step_rows: list[dict], command: str, machine: str, threads: int) -> str:
    lines = ["# The compiled CPU decode step: whole or by layer", "", f"Command: `{command}`  ",
             f"Machine: {machine} ({threads} threads in the measured processes)", "",
             "`first step s`: the first decode step of a fresh process with an empty Inductor cache (Dynamo, "
             "Inductor, the C++ compiler), median over the repeats; `step ms`: the median decode step afterwards, "
             "both variants in one process, alternating rounds.", ""]
    batches = sorted({b for r in step_rows for v in r["step_ms"].values() for b in v}, key=int)
    lines += ["| model | variant | first step s (runs) | graphs | "
              + " | ".join(f"step ms, batch {b}" for b in batches) + " |", "|---" * (4 + len(batches)) + "|"]
    steps_of = {r["model"]: r["step_ms"] for r in step_rows}
    for (model, variant), group in _groups(cold_rows).items():
        firsts = [r["first_step_s"] for r in group]
        runs = ", ".join(f"{f:.1f}" for f in firsts)
        cells = [f"{statistics.median(firsts):.1f} ({runs})", str(group[0]["graphs"])]
        cells += [f"{steps_of[model][variant][b]:.2f}" if model in steps_of else "-" for b in batches]
        lines.append(f"| {model} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _groups(rows):
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["variant"]), []).append(r)
    return groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="kvbound")
    p.add_argument("--batches", default="1,4", help="decode batch sizes, comma-separated (cold: the first)")
    p.add_argument("--total", type=int, default=1024, help="prompt + new tokens of the timed request")
    p.add_argument("--steps", type=int, default=30, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2, help="cold processes per model and variant")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="folder for compile_regions.json / .md")
    args = p.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"--batches {args.batches!r}: comma-separated positive integers") from None
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        kind, model = args.child[:2]
        result = (cold(model, args.child[2], batches[0], args.total) if kind == "cold" else
                  steps(model, batches, args.total, args.steps, args.rounds))
        print(json.dumps(result))
        return
    models = args.models.split(",")
    bad = [m for m in models if m not in MODELS]
    if bad or min(batches + [args.total, args.steps, args.rounds, args.repeats, args.threads]) < 1 or args.total < 4:
        raise SystemExit(f"--models from {', '.join(MODELS)} (got {bad or models}); --batches, --steps, --rounds, "
                         "--repeats, --threads >= 1 and --total >= 4")
    from tqdm.auto import tqdm

    from h2o_compile.reporting import machine_description

    runs = [("cold", m, v) for _ in range(args.repeats) for m in models for v in VARIANTS]
    runs += [("steps", m) for m in models]
    cold_rows, step_rows = [], []
    for run in tqdm(runs, desc="processes", unit="run"):
        row = run_child(args, *run, fresh_cache=run[0] == "cold")
        (cold_rows if run[0] == "cold" else step_rows).append(row)
        tqdm.write(json.dumps(row))
    command = "python research/compile_regions.py " + " ".join(sys.argv[1:])
    text = markdown(cold_rows, step_rows, command, machine_description(), args.threads)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compile_regions.json").write_text(json.dumps({"command": command, "cold": cold_rows,
                                                              "steps": step_rows}, indent=1))
        (out / "compile_regions.md").write_text(text)


if __name__ == "__main__":
    main()
