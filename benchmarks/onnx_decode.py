"""ONNX Runtime decode throughput: H2O (budget 0.2) with the ONNX function and with the native custom op,
against the same exporter with policy ``full`` and the PyTorch H2OModel (eager, no torch.compile).

    python benchmarks/onnx_decode.py                       # the full measurement (2k context, batch 1 and 8)
    python benchmarks/onnx_decode.py --smoke               # tiny sizes, proves the script works (to /tmp)

A random-weight Llama-style model (KV-bound: small hidden size, many cached tokens) is exported twice with
``export_onnx``: once with the H2O cache (C = ceil(budget x context)) and once with ``policy="full"``
(C = context). The H2O file is opened twice with ``H2OOrtModel`` on the CPU provider: ``native=False`` (ONNX
Runtime inlines the H2OAttention function into standard ops) and ``native=True`` (our C++ kernel, state
written in place); the full-cache file with the function. The PyTorch row runs ``h2o_compile.optimize(model,
compile=False)`` with the same budget and prefill chunks. For each, a prompt of ``context - steps``
tokens is prefilled (timed separately, in chunks so its memory stays bounded) and ``steps`` single-token
decode steps follow, the last of them at the full context. The first ``--warmup`` decode steps are excluded;
latencies are medians over the rest. Results go to docs/results/onnx_decode.{json,md} with the command and
the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import torch

from h2o_compile.export.onnx import export_onnx
from h2o_compile.export.ort import H2OOrtModel

SMOKE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 4, "intermediate": 128, "vocab": 512,
         "context": 160, "steps": 12, "warmup": 2, "batches": [1, 2], "prefill_chunk": 64}


def build_model(args) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context, initializer_range=0.05)
    torch.manual_seed(args.seed)
    return transformers.LlamaForCausalLM(config).eval()


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    try:
        import onnxruntime

        info["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        info["cpu"] = fields.get("Model name", "?").strip()
        info["cpus"] = fields.get("CPU(s)", "?").strip()
    except (OSError, subprocess.CalledProcessError):
        info["cpu"] = platform.processor()
    info["usable_cores"] = usable_cores()
    return info


def open_runner(variant: str, source, args, threads: int):
    """The model to time: an H2OOrtModel of an exported dir (variants full / function / native) or the
    PyTorch H2OModel of the transformers model (variant torch)."""
    if variant == "torch":
        import h2o_compile

        return h2o_compile.optimize(source, args.budget, prefill=args.prefill_chunk, compile=False)
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return H2OOrtModel.from_pretrained(source, provider="cpu", session_options=options,
                                       native=variant == "native")


def measure(variant: str, source, batch: int, args, threads: int) -> dict:
    """Prefill (timed alone) then ``steps`` decode steps; returns medians over the steps after warm-up."""
    load_before = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    model = open_runner(variant, source, args, threads)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (batch, args.context - args.steps), generator=gen)
    model.reset(batch, args.context)
    start = time.perf_counter()
    logits = model.step(prompt)
    prefill_s = time.perf_counter() - start
    token = logits[:, -1].argmax(-1, keepdim=True)
    latencies = []
    for _ in range(args.steps):
        start = time.perf_counter()
        logits = model.step(token)
        latencies.append(time.perf_counter() - start)
        token = logits[:, -1].argmax(-1, keepdim=True)
    timed = latencies[args.warmup:]
    median = statistics.median(timed)
    return {
        "batch": batch, "capacity": model.capacity, "kv_cache_mib": round(model.kv_cache_bytes() / 2**20, 2),
        "prefill_tokens": prompt.shape[1], "prefill_s": round(prefill_s, 3),
        "decode_steps_timed": len(timed), "step_ms_median": round(median * 1e3, 3),
        "step_ms_min": round(min(timed) * 1e3, 3), "step_ms_max": round(max(timed) * 1e3, 3),
        "tokens_per_s": round(batch / median, 2),
        # The CPU may be shared: the 1-minute load average before and after the row shows contention.
        "load_avg_before": load_before,
        "load_avg_after": round(os.getloadavg()[0], 2) if load_before is not None else None,
    }


def markdown(result: dict) -> str:
    cfg, mach = result["config"], result["machine"]
    machine_line = (f"Machine: {mach.get('cpu')} ({mach.get('cpus')} CPUs, {mach.get('usable_cores')} "
                    f"usable), onnxruntime {mach.get('onnxruntime')}, torch {mach.get('torch')}, "
                    f"{cfg['threads']} intra-op threads.")
    model_line = (f"Model: random Llama-style, hidden {cfg['hidden']}, {cfg['layers']} layers, "
                  f"{cfg['heads']} heads ({cfg['kv_heads']} KV), vocab {cfg['vocab']}, fp32. "
                  f"Context {cfg['context']} tokens: a prompt of {cfg['context'] - cfg['steps']} (prefill, "
                  f"chunks of {cfg['prefill_chunk']}, timed separately) then {cfg['steps']} decode steps; "
                  f"the first {cfg['warmup']} are warm-up, latencies are medians of the rest.")
    header = ("| runner | policy | batch | C (slots) | KV state MiB | step ms (median) | tokens/s | prefill s "
              "| vs full | vs function | load avg before / after |")
    lines = ["# ONNX Runtime decode: H2O (ONNX function, native op) vs full cache vs PyTorch eager", "",
             f"Command: `{result['command']}`", "", machine_line, "", model_line, "", VARIANT_NOTE, "", header,
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['variant']} | {row['policy']} | {row['batch']} | {row['capacity']} | "
                     f"{row['kv_cache_mib']} | {row['step_ms_median']} | {row['tokens_per_s']} | {row['prefill_s']} | "
                     f"{row.get('speedup_vs_full', '')} | {row.get('speedup_vs_function', '')} | "
                     f"{row.get('load_avg_before', '?')} / {row.get('load_avg_after', '?')} |")
    if result.get("note"):
        lines += ["", result["note"]]
    return "\n".join(lines) + "\n"


VARIANTS = {"full": "full", "function": "h2o", "native": "h2o", "torch": "h2o"}  # variant -> policy
VARIANT_NOTE = ("Runners: `full` = ONNX Runtime, policy full (C = context), ONNX function; `function` = ONNX "
                "Runtime, H2O, the model-local H2OAttention function inlined into standard ops; `native` = ONNX "
                "Runtime, H2O, the native C++ custom op (export/native), state in place; `torch` = "
                "h2o_compile.optimize(model, compile=False), PyTorch eager over the reference op.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=2048, help="prompt + decode steps")
    ap.add_argument("--steps", type=int, default=40, help="decode steps, warm-up included")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0 = all usable cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="path without extension (default docs/results/onnx_decode, "
                    "or onnx_decode_smoke in the temp dir with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script works")
    ap.add_argument("--note", default="", help="a remark stored with the results (e.g. about the machine)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="runners to time (default all)")
    args = ap.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.out is None:
        args.out = str(Path(tempfile.gettempdir()) / "onnx_decode_smoke" if args.smoke
                       else REPO / "docs/results/onnx_decode")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    os.environ["H2O_NATIVE_THREADS"] = str(threads)  # the native kernel's prefill workers, like ORT's pool

    model = build_model(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for policy, budget in (("h2o", args.budget), ("full", 1.0)):
            start = time.perf_counter()
            dirs[policy] = export_onnx(model, Path(tmp) / policy, budget=budget, policy=policy,
                                       max_seq_len=args.context, prefill=args.prefill_chunk)
            print(f"exported {policy} in {time.perf_counter() - start:.1f}s", flush=True)
        for batch in args.batches:
            by_variant = {}
            for variant in args.variants:
                policy = VARIANTS[variant]
                source = model if variant == "torch" else dirs[policy]
                row = {"variant": variant, "policy": policy, **measure(variant, source, batch, args, threads)}
                print(json.dumps(row), flush=True)
                by_variant[variant] = row
                rows.append(row)
            for variant, row in by_variant.items():
                for base in ("full", "function"):
                    if base in by_variant and variant != base and variant != "full":
                        row[f"speedup_vs_{base}"] = round(row["tokens_per_s"] / by_variant[base]["tokens_per_s"], 2)

    keys = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "context", "steps", "warmup",
            "batches", "budget", "prefill_chunk", "seed")
    config = {k: getattr(args, k) for k in keys}
    config["threads"] = threads
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO)] + sys.argv[1:])
    result = {"command": command, "machine": machine(), "config": config, "rows": rows}
    if args.note:
        result["note"] = args.note
    loads = os.getloadavg() if hasattr(os, "getloadavg") else None
    if loads is not None:
        result["load_average_at_end"] = [round(x, 2) for x in loads]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
