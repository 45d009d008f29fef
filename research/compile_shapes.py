"""Static shapes per bucket or one dynamic-shape step? The measurement behind H2OModel's choice.

For a few (batch, total) shapes of the KV-bound model, on the same cache: the decode step time of
H2OModel's compiled step (one graph, batch and cache slots dynamic) against a step compiled for that exact
shape (what a bucketed design compiles once per bucket), and what each compile costs.

    python research/compile_shapes.py            # -> docs/results/compile_shapes.{json,md}
    python research/compile_shapes.py --smoke    # the smoke model, seconds, output under /tmp
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Compile costs are measured cold: an Inductor cache of this process only (a warm on-disk cache from an earlier
# run would hide most of them).
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="h2o-compile-shapes-")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

import h2o_compile  # noqa: E402
from h2o_compile.bench.decode import build_model  # noqa: E402
from h2o_compile.reporting import command_line, machine_description, markdown_table, write_json  # noqa: E402
from h2o_compile.runtime.compiling import compile_step  # noqa: E402
from h2o_compile.runtime import decode_step_graph  # noqa: E402


def timed_steps(opt, tokens: torch.Tensor) -> tuple[float, list[float]]:
    """(first step seconds, the others' seconds): one token per step from ``tokens`` [B, n]."""
    times = []
    for i in range(tokens.shape[1]):
        t0 = time.perf_counter()
        opt.step(tokens[:, i:i + 1])
        times.append(time.perf_counter() - t0)
    return times[0], times[1:]


@torch.no_grad()
def measure(model, shapes, steps: int, budget: float) -> list[dict]:
    opt = h2o_compile.optimize(model, budget=budget, compile=True)
    vocab = model.config.vocab_size
    rows = []
    for batch, total in shapes:
        gen = torch.Generator().manual_seed(batch * total)
        ids = torch.randint(0, vocab, (batch, total), generator=gen)
        opt.reset(batch, total)
        opt.step(ids[:, :total - 4 * steps], logits_to_keep=1)  # the prompt (eager): the cache is full
        opt.compile_mode = False  # the eager step, for what compiling buys at all
        _, eager = timed_steps(opt, ids[:, total - 4 * steps:total - 3 * steps])
        opt.compile_mode = True
        first_dynamic, dynamic = timed_steps(opt, ids[:, total - 3 * steps:total - 2 * steps])
        shared = opt._compiled_step
        # The same step compiled for exactly this shape, as a bucket would be: a fresh GraphModule (its own
        # code object, so a fresh compile), static shapes.
        static_step = compile_step(decode_step_graph(opt.graph, "default", opt.device), "default", opt.device,
                                   dynamic=False)
        # A function, as H2OModel's own step: an nn.Module here would become a child module of opt, which the
        # restore below could not overwrite with a function.
        opt._compiled_step = lambda *inputs, step=static_step: step(*inputs)
        compile_static, static = timed_steps(opt, ids[:, total - 2 * steps:total - steps])
        opt._compiled_step = shared
        _, dynamic_again = timed_steps(opt, ids[:, total - steps:])
        dynamic += dynamic_again
        rows.append({"batch": batch, "total": total, "capacity": opt.stream.capacity,
                     "eager_ms": 1e3 * statistics.median(eager), "dynamic_ms": 1e3 * statistics.median(dynamic),
                     "static_ms": 1e3 * statistics.median(static),
                     "first_dynamic_step_s": first_dynamic, "static_compile_s": compile_static})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--steps", type=int, default=24)
    args = p.parse_args(argv)
    name, shapes = ("smoke", [(1, 256), (4, 256)]) if args.smoke else ("kvbound", [(1, 1024), (8, 1024), (8, 4096)])
    torch.manual_seed(0)
    rows = measure(build_model(name), shapes, args.steps, budget=0.2)
    prefix = Path("/tmp/compile_shapes" if args.smoke else ROOT / "docs/results/compile_shapes")
    payload = {"command": command_line(), "machine": machine_description(), "model": name, "rows": rows}
    write_json(prefix.with_suffix(".json"), payload)
    compile_s = rows[0]["first_dynamic_step_s"]
    table = markdown_table(["batch", "total", "C", "eager step ms", "dynamic step ms", "static step ms",
                            "dynamic / static", "first dynamic step s", "static compile s",
                            "tokens to pay back the compile"],
                           [[r["batch"], r["total"], r["capacity"], r["eager_ms"], r["dynamic_ms"], r["static_ms"],
                             r["dynamic_ms"] / r["static_ms"], r["first_dynamic_step_s"], r["static_compile_s"],
                             round(r["batch"] * compile_s / max(1e-9, (r["eager_ms"] - r["dynamic_ms"]) / 1e3))]
                            for r in rows])
    text = (f"# One dynamic-shape decode step vs a step per static shape: {name}\n\nCommand: "
            f"`{payload['command']}`  \nMachine: {payload['machine']}\n\nMedian decode step time on the same "
            f"cache (budget 0.2), {args.steps} steps each: H2OModel's compiled step (one graph for every batch "
            f"size and capacity) vs the same step compiled for exactly that shape. `first dynamic step`: the "
            f"first step at that shape (the first row pays the one compile). `static compile`: what each "
            f"bucket of a bucketed design would pay once. `tokens to pay back`: the one dynamic compile (first row) "
            f"over the time the compiled step saves per step, times the batch (tokens generated).\n\n{table}\n")
    prefix.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
