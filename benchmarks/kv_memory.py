"""The largest batch whose KV state fits a memory cap: transformers' own cache vs H2O vs H2O with int8 entries.

For each model and sequence length: the bytes one sequence's cache holds at its end, as each runtime
allocates them (``H2OModel.reset(1, N)`` then ``kv_cache_bytes()`` for H2O in the model's dtype and with
``kv_dtype="int8"``; ``hf_cache_bytes`` for transformers' DynamicCache(config=...), every token of a global
layer and W - 1 of a sliding one); the batch that fits ``--cap-mib`` is cap // bytes. Then each H2O batch is
allocated for real (``reset(B, N)``) to check that its state is what the arithmetic says and stays under the
cap. Weights and activations are not counted: the cap is the KV cache's share of memory.

    python benchmarks/kv_memory.py                                  # kvbound + Gemma 3 270M, 4096 tokens
    python benchmarks/kv_memory.py --models kvbound --lengths 1024,4096 --cap-mib 1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import h2o_compile  # noqa: E402
from h2o_compile.cli.arguments import csv_of  # noqa: E402
from h2o_compile.reporting import command_line, machine_description, markdown_table, write_json  # noqa: E402


def load(name: str):
    if name == "gemma3-270m":
        from h2o_compile.zoo import load_gemma3_270m

        return load_gemma3_270m()[0]
    from h2o_compile.bench.decode import build_model

    return build_model(name)


def measure(name: str, length: int, budget: float, cap: int) -> dict:
    model = load(name)
    row = {"model": name, "tokens": length, "budget": budget, "cap_bytes": cap}
    for label, kv_dtype in (("h2o", "model"), ("h2o_int8", "int8")):
        opt = h2o_compile.optimize(model, budget=budget, kv_dtype=kv_dtype, compile=False)
        opt.reset(1, length)
        per_row = opt.kv_cache_bytes()
        batch = cap // per_row
        opt.reset(batch, length)  # allocated for real: the state of that batch, as the runtime holds it
        allocated = opt.kv_cache_bytes()
        assert allocated == batch * per_row <= cap, (label, allocated, batch, per_row)
        row[label] = {"bytes_per_sequence": per_row, "batch": batch, "allocated_bytes": allocated}
        row["transformers"] = {"bytes_per_sequence": opt.hf_cache_bytes(1, length)}
        row["full"] = {"bytes_per_sequence": opt.full_cache_bytes(1, length)}
        del opt
    for label in ("transformers", "full"):
        row[label]["batch"] = cap // row[label]["bytes_per_sequence"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=csv_of(str), default=["kvbound", "gemma3-270m"])
    parser.add_argument("--lengths", type=csv_of(int), default=[4096])
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--cap-mib", type=int, default=1024, help="memory for the KV cache (MiB)")
    parser.add_argument("--out", default="docs/results/kv_memory")
    args = parser.parse_args(argv)
    cap = args.cap_mib << 20
    rows = [measure(m, n, args.budget, cap) for m in args.models for n in args.lengths]
    table = [[r["model"], r["tokens"],
              *(f"{r[k]['bytes_per_sequence'] / 2**20:.2f} MiB / {r[k]['batch']}"
                for k in ("transformers", "h2o", "h2o_int8")),
              f"{r['h2o_int8']['bytes_per_sequence'] / r['h2o']['bytes_per_sequence']:.3f}",
              f"{r['h2o_int8']['batch'] / max(1, r['h2o']['batch']):.2f}x",
              f"{r['h2o_int8']['batch'] / max(1, r['transformers']['batch']):.1f}x"] for r in rows]
    header = ["model", "tokens", "transformers cache: per sequence / batch", f"H2O {args.budget:g}",
              f"H2O {args.budget:g} int8", "int8 / fp state", "int8 batch / H2O", "int8 batch / transformers"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out.with_suffix(".json"), {"command": command_line(), "machine": machine_description(),
                                          "cap_mib": args.cap_mib, "rows": rows})
    text = (f"# KV memory: the batch that fits {args.cap_mib} MiB of KV cache\n\n"
            f"Command: `{command_line()}`\n\nMachine: {machine_description()}\n\n"
            + markdown_table(header, table) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
