"""The compiled CPU decode step, compiled whole or one decoder layer at a time (``regional_compile``): the cold
compile (the first decode step, an empty Inductor cache) and the step time after it, each in a fresh process:

    python benchmarks/compile_regions.py --models kvbound,gemma3-270m --out docs/results/compile_regions_cpu

Per model and variant (alternating, ``--repeats`` times): seconds to the first decoded token's step (Dynamo +
Inductor + the C++ compiler; the prompt's prefill is excluded), the graphs Dynamo compiled, and the median decode
step at each batch size over ``--steps`` steps of a request of ``--total`` tokens (prompt half the total).
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


def child(model_name: str, variant: str, batches: list[int], total: int, steps: int) -> dict:
    """Runs in a fresh process (an empty Inductor cache is set by the parent)."""
    import torch
    from torch._dynamo.utils import counters

    import h2o_compile
    from h2o_compile.bench.serve import load_model

    torch.manual_seed(0)
    model = load_model(model_name, "cpu")
    opt = h2o_compile.optimize(model, budget=0.2, compile=True, regional_compile=VARIANTS[variant])
    vocab = opt.vocab_size
    result = {"model": model_name, "variant": variant, "step_ms": {}}
    with torch.no_grad():
        for i, batch in enumerate(batches):
            opt.reset(batch, total)
            opt.step(torch.randint(0, vocab, (batch, total // 2)))        # the prompt: eager prefill
            token = torch.randint(0, vocab, (batch, 1))
            start = time.perf_counter()
            opt.step(token)                                                  # first decode step: compiles
            first = time.perf_counter() - start
            if i == 0:
                result["first_step_s"] = first
                result["graphs"] = counters["stats"]["unique_graphs"]
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                opt.step(token)
                times.append(time.perf_counter() - start)
            result["step_ms"][str(batch)] = 1000 * statistics.median(times[steps // 5:])  # skip warm-up steps
    result["graphs_after"] = counters["stats"]["unique_graphs"]
    return result


def run_fresh(model: str, variant: str, args) -> dict:
    """``child`` in a new interpreter with an Inductor cache of its own, so every compile is cold."""
    with tempfile.TemporaryDirectory(prefix="h2o_inductor_") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, __file__, "--child", model, variant, "--batches", args.batches,
                              "--total", str(args.total), "--steps", str(args.steps), "--threads", str(args.threads)],
                             env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{model} / {variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict], command: str, machine: str) -> str:
    lines = ["# The compiled CPU decode step: whole or by layer", "", f"Command: `{command}`  ",
             f"Machine: {machine}", "",
             "Each row a fresh process with an empty Inductor cache; `first step s`: the first decode step (Dynamo, "
             "Inductor, the C++ compiler), `step ms`: the median decode step afterwards. Medians over the repeats.",
             ""]
    batches = sorted({b for r in rows for b in r["step_ms"]}, key=int)
    lines += ["| model | variant | first step s | graphs | " + " | ".join(f"step ms, batch {b}" for b in batches)
              + " | runs |", "|---" * (5 + len(batches)) + "|"]
    for (model, variant), group in _groups(rows).items():
        cells = [f"{statistics.median(r['first_step_s'] for r in group):.1f}", str(group[0]["graphs"])]
        cells += [f"{statistics.median(r['step_ms'][b] for r in group):.2f}" for b in batches]
        lines.append(f"| {model} | {variant} | " + " | ".join(cells) + f" | {len(group)} |")
    return "\n".join(lines) + "\n"


def _groups(rows):
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["variant"]), []).append(r)
    return groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="kvbound")
    p.add_argument("--batches", default="1,4", help="decode batch sizes, comma-separated")
    p.add_argument("--total", type=int, default=1024, help="prompt + new tokens of the timed request")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="folder for compile_regions.json / .md")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(child(*args.child, batches, args.total, args.steps)))
        return
    models = args.models.split(",")
    bad = [m for m in models if m not in MODELS]
    if bad or min(batches + [args.total, args.steps, args.repeats]) < 1 or args.total < 4:
        raise SystemExit(f"--models from {', '.join(MODELS)} (got {bad or models}); --batches, --steps, --repeats "
                         ">= 1 and --total >= 4")
    from tqdm.auto import tqdm

    from h2o_compile.reporting import machine_description

    runs = [(m, v) for _ in range(args.repeats) for m in models for v in VARIANTS]
    rows = []
    for model, variant in tqdm(runs, desc="fresh processes", unit="run"):
        rows.append(run_fresh(model, variant, args))
        tqdm.write(json.dumps(rows[-1]))
    command = "python benchmarks/compile_regions.py " + " ".join(sys.argv[1:])
    text = markdown(rows, command, machine_description())
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compile_regions.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
        (out / "compile_regions.md").write_text(text)


if __name__ == "__main__":
    main()
