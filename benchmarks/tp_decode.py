"""Tensor-parallel H2O decode: per-rank state bytes, decode step time and tokens/s at N ranks x T threads.

    python benchmarks/tp_decode.py                 # CPU, gloo: 1x1, 1x2 (one process, two threads), 2x1 (two
                                                   # ranks, one thread each) -> docs/results/tp_cpu.{md,json}
    python benchmarks/tp_decode.py --smoke         # tiny sizes, seconds, output under /tmp/tp_decode_smoke
    python benchmarks/tp_decode.py --device cuda --configs 1x1,1x1tp,2x1 --out OUT/tp_cuda   # NCCL

A config ``NxT`` runs N ranks of T threads each in fresh processes (torch.multiprocessing spawn); N = 1 is the
plain library path (``optimize`` without ``tp``), ``1x1tp`` the tensor-parallel path over a one-rank group
(on a one-GPU machine: the NCCL collectives inside the captured and compiled step, without a second GPU). Every
config decodes the same random Llama-like model (GQA) from the same prompt; rank 0 times each decode step
(the ranks meet in every all-reduce, so its clock is the step's) and the script checks that every config
produced the same greedy tokens. The all-reduces' own cost is measured apart: the step's 2 x layers
all-reduces of a [B, 1, hidden] tensor, alone, on the same group.

Time it only on an otherwise idle machine: the report records the load average before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# About 100M parameters: a decode step reads every weight once, so it is memory-bound on the CPU as real models
# are, and splitting the weights over ranks has something to win against the all-reduces' latency.
FULL = dict(model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=8192, max_position_embeddings=4096),
            batch=4, prompt=512, new=64, budget=0.2)
SMOKE = dict(model=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256),
             batch=2, prompt=24, new=6, budget=0.5)


def parse_config(text: str) -> tuple[int, int, bool]:
    """``"2x1"`` -> (ranks 2, threads 1, tp True); ``"1x2"`` -> (1, 2, False); ``"1x1tp"`` -> (1, 1, True)."""
    tp = text.endswith("tp")
    ranks, _, threads = text.removesuffix("tp").partition("x")
    try:
        n, t = int(ranks), int(threads or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"config {text!r}: expected NxT, e.g. 2x1 or 1x1tp") from None
    if n < 1 or t < 1:
        raise argparse.ArgumentTypeError(f"config {text!r}: N and T must be >= 1")
    return n, t, tp or n > 1


def build_model(sizes: dict, device: str):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(initializer_range=0.05, **sizes)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _worker(rank: int, world: int, threads: int, tp: bool, args: dict, out: str) -> None:
    import torch.distributed as dist

    import h2o_compile

    torch.set_num_threads(threads)
    sizes = SMOKE if args["smoke"] else FULL
    device = "cpu"
    if args["device"] == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    group = None
    if tp:
        dist.init_process_group("nccl" if args["device"] == "cuda" else "gloo", init_method=args["init"], rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=300))
        group = dist.group.WORLD
    model = build_model(sizes["model"], args["device"]).to(device)
    opt = h2o_compile.optimize(model, sizes["budget"], tp=tp, compile=args["compile"])
    batch, prompt, new = sizes["batch"], sizes["prompt"], sizes["new"]
    ids = torch.randint(0, sizes["model"]["vocab_size"], (batch, prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def run(record: bool):
        opt.reset(batch, prompt + new)
        sync()
        start = time.perf_counter()
        logits = opt.step(ids, logits_to_keep=1)[:, -1]
        sync()
        prefill = time.perf_counter() - start
        tokens, steps = [], []
        for _ in range(new):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token)
            start = time.perf_counter()
            logits = opt.step(token)[:, -1]
            sync()
            steps.append(time.perf_counter() - start)
        return prefill, steps, torch.cat(tokens, dim=1).cpu()

    run(False)  # warm: the first step builds the eager step graph (or compiles it)
    prefill, steps, tokens = run(True)
    comm = _allreduce_cost(group, batch, sizes["model"], device, sync) if group is not None else 0.0
    if rank == 0:
        median = statistics.median(steps)
        row = dict(config=f"{world}x{threads}{'tp' if tp and world == 1 else ''}", ranks=world, threads=threads,
                   tp=tp, state_bytes_per_rank=opt.kv_cache_bytes(), kv_heads_per_rank=opt.layers[0].kv_heads,
                   slots=opt.stream.capacity, step_ms=1e3 * median, step_ms_p10=1e3 * _quantile(steps, 0.1),
                   step_ms_p90=1e3 * _quantile(steps, 0.9), tokens_per_s=batch / median, prefill_s=prefill,
                   allreduce_ms_per_step=1e3 * comm, tokens=tokens.tolist())
        Path(out, "row.json").write_text(json.dumps(row))
    if group is not None:
        dist.destroy_process_group()


def _allreduce_cost(group, batch: int, sizes: dict, device: str, sync) -> float:
    """Seconds of the 2 x layers all-reduces of a decode step, alone: [B, 1, hidden] each, median of 20."""
    from torch.distributed import _functional_collectives as funcol

    x = torch.randn(batch, 1, sizes["hidden_size"], device=device)
    times = []
    for _ in range(21):
        sync()
        start = time.perf_counter()
        for _ in range(2 * sizes["num_hidden_layers"]):
            x = funcol.all_reduce(x, "sum", group) * 0.5  # the product waits for the collective
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_config(text: str, args: argparse.Namespace) -> dict:
    ranks, threads, tp = parse_config(text)
    with tempfile.TemporaryDirectory() as tmp:
        shared = dict(smoke=args.smoke, device=args.device, compile=args.compile, init=f"file://{tmp}/rendezvous")
        mp.start_processes(_worker, args=(ranks, threads, tp, shared, tmp), nprocs=ranks, start_method="spawn")
        return json.loads(Path(tmp, "row.json").read_text())


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    import transformers

    info = dict(cpu=cpu, cores=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
                transformers=transformers.__version__)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def report(rows: list[dict], args: argparse.Namespace, meta: dict) -> str:
    sizes = SMOKE if args.smoke else FULL
    # The comparison: N ranks of one thread against one process with as many threads (same cores).
    base = next((row for row in rows if row["config"] == "1x2"), rows[0])
    lines = [f"# Tensor-parallel H2O decode ({args.device})", "",
             f"Command: `{meta['command']}`", "",
             f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores; torch {meta['machine']['torch']}, "
             f"transformers {meta['machine']['transformers']}" + (f"; {meta['machine']['gpu']}" if 'gpu' in
                                                                 meta['machine'] else ""),
             f"Load average before / after: {meta['load_before']} / {meta['load_after']}", "",
             f"Model: random Llama {sizes['model']}; batch {sizes['batch']}, prompt {sizes['prompt']}, "
             f"{sizes['new']} greedy tokens, budget {sizes['budget']}, compile={args.compile}. NxT = N ranks "
             "of T threads; N = 1 without tp is the plain library path.", "",
             "| config | KV heads / rank | state bytes / rank | step ms (p10-p90) | tokens/s | all-reduce ms / step "
             f"| step vs {base['config']} | tokens = {rows[0]['config']}'s |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['kv_heads_per_rank']} | {row['state_bytes_per_rank']:,} | "
                     f"{row['step_ms']:.2f} ({row['step_ms_p10']:.2f}-{row['step_ms_p90']:.2f}) | "
                     f"{row['tokens_per_s']:.1f} | {row['allreduce_ms_per_step']:.3f} | "
                     f"{row['step_ms'] / base['step_ms']:.2f}x | {row['tokens'] == rows[0]['tokens']} |")
    single = next((row for row in rows if row["ranks"] == 1 and row["threads"] == 1 and not row["tp"]), None)
    for row in rows:
        if row["ranks"] > 1:
            comm, step = row["allreduce_ms_per_step"], row["step_ms"]
            whole = f" against {single['step_ms']:.2f} ms for the whole model at one thread (1x1)" if single else ""
            lines += ["", f"{row['config']}: the step's all-reduces alone take {comm:.2f} ms of its {step:.2f} ms "
                      f"({100 * comm / step:.0f}%); the rest, {step - comm:.2f} ms, is each rank's share of the "
                      f"model{whole}; state per rank "
                      f"{row['state_bytes_per_rank'] / base['state_bytes_per_rank']:.2f}x {base['config']}'s."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="1x1,1x2,2x1", help="comma-separated NxT (default 1x1,1x2,2x1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--compile", action="store_true", help="compile the decode step (optimize(compile=True))")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, output under /tmp/tp_decode_smoke")
    parser.add_argument("--out", default=None, help="output stem (default docs/results/tp_cpu)")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        parse_config(c)
    stem = Path(args.out or ("/tmp/tp_decode_smoke/tp" if args.smoke else "docs/results/tp_cpu"))
    stem.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(command=" ".join(["python benchmarks/tp_decode.py", *(sys.argv[1:] if argv is None else argv)]),
                machine=machine(), load_before=_load())
    rows = []
    for c in configs:
        rows.append(run_config(c, args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
    meta["load_after"] = _load()
    Path(f"{stem}.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    text = report(rows, args, meta)
    Path(f"{stem}.md").write_text(text)
    print(text)
    return 0 if all(row["tokens"] == rows[0]["tokens"] for row in rows) else 1


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
