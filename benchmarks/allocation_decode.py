"""Decode speed of a calibrated split (H2OConfig.allocation) against the uniform split of the same rule, on the
compiled CPU step: the same model, budget and batch, the calibrated split's slots summing to the uniform one's.

    python benchmarks/allocation_decode.py --model gemma3-270m --config docs/results/allocation/gemma3/h2o_config.json \
        --out docs/results/allocation/gemma3/decode

Per batch size: a prompt of ``--prompt`` tokens fills the cache (sized for prompt + ``--steps`` + warm-up), then
``--steps`` one-token steps are timed; the two configs alternate ``--repeats`` times and the median of each is
kept, so a disturbance hits both alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import h2o_compile
from h2o_compile.zoo.loading import load_pretrained


def decode_seconds(opt, ids: torch.Tensor, steps: int, warmup: int) -> float:
    """Seconds per decode step after a prompt ``ids`` [B, P] (warm-up steps untimed)."""
    opt.reset(ids.shape[0], ids.shape[1] + warmup + steps)
    logits = opt.step(ids, logits_to_keep=1)[:, -1]
    token = logits.argmax(-1, keepdim=True)
    for _ in range(warmup):
        token = opt.step(token)[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(steps):
        token = opt.step(token)[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--config", required=True, help="h2o_config.json written by h2o-compile calibrate --out")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=896)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True, help="path without extension for .json / .md")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, _ = load_pretrained(args.model)
    split = h2o_compile.H2OConfig.from_dict(json.loads(Path(args.config).read_text()))
    configs = {"uniform": split.replace(allocation="uniform"), "calibrated": split}
    opts = {name: h2o_compile.optimize(model, config=config, compile=True) for name, config in configs.items()}
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(10, model.config.vocab_size - 10, (batch, args.prompt))
        times = {name: [] for name in opts}
        for _ in range(args.repeats):
            for name, opt in opts.items():
                times[name].append(decode_seconds(opt, ids, args.steps, args.warmup))
        row = {"batch": batch}
        for name, opt in opts.items():
            row[f"{name}_tokens_per_s"] = batch / statistics.median(times[name])
            row[f"{name}_state_mib"] = opt.kv_cache_bytes() / 2**20
            row[f"{name}_slots"] = opt.stream.slots
        row["ratio"] = row["calibrated_tokens_per_s"] / row["uniform_tokens_per_s"]
        rows.append(row)
        print({k: v for k, v in row.items() if not k.endswith("slots")}, flush=True)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads; torch " \
              f"{torch.__version__}, Python {platform.python_version()}"
    command = "python benchmarks/allocation_decode.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "machine": machine, "rows": rows}, indent=1))
    lines = [f"# Decode speed: calibrated split vs uniform ({args.model})", "", f"Command: `{command}`  ",
             f"Machine: {machine}", "", "Compiled CPU step; prompt of "
             f"{args.prompt} tokens, {args.steps} timed steps, median of {args.repeats} alternating runs.", "",
             "| batch | uniform tokens/s | calibrated tokens/s | calibrated / uniform | state MiB (uniform, "
             "calibrated) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['uniform_tokens_per_s']:.1f} | {r['calibrated_tokens_per_s']:.1f} | "
                     f"{r['ratio']:.3f} | {r['uniform_state_mib']:.2f}, {r['calibrated_state_mib']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
