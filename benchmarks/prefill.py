"""Prefill benchmark: H2O's prompt block vs transformers' own SDPA prefill, same process, alternating, medians.

For each (model, prompt length, batch): transformers' forward over the prompt with ``use_cache=True`` (its
DynamicCache, SDPA attention, last-position logits only, as generate does) and H2OModel.step(prompt,
logits_to_keep=1) after reset(batch, prompt + 16) at each policy, alternating contenders every repeat, so a
drift of the machine hits all of them alike. Peak memory: tracemalloc cannot see torch's allocator, so the
peak resident set of a fresh child process per contender is reported instead (``--memory``).

    python benchmarks/prefill.py                                   # kvbound, 1024 / 4096, batch 1 and 8
    python benchmarks/prefill.py --model gemma3-270m --lengths 1024,4096 --batches 1
    python benchmarks/prefill.py --smoke                           # seconds, output under /tmp
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from h2o_compile.config import parse_options  # noqa: E402
from h2o_compile.reporting import command_line, machine_description, markdown_table, write_json  # noqa: E402


def load(name: str):
    if name == "gemma3-270m":
        from h2o_compile import zoo

        return zoo.load_gemma3_270m()[0]
    from h2o_compile.bench.decode import build_model

    return build_model(name)


def contenders(model, policies):
    """name -> callable(prompt) running one prefill."""
    import h2o_compile

    def hf(prompt):
        model(input_ids=prompt, use_cache=True, logits_to_keep=1)

    runs = {"transformers-sdpa": hf}
    for spec in policies:
        # "h2o+window=64+pool=9": the policy, then a score rule as `h2o-compile tasks --rules` reads it
        policy, _, rule = spec.partition("+")
        options = parse_options(rule) if rule else {}
        opt = h2o_compile.optimize(model, budget=0.2, policy=policy, compile=False, **options)

        def h2o(prompt, opt=opt):
            opt.reset(prompt.shape[0], prompt.shape[1] + 16)
            opt.step(prompt, logits_to_keep=1)

        runs[f"h2o-{spec}@0.2"] = h2o
    return runs


@torch.no_grad()
def measure(model_name: str, lengths, batches, policies, repeats: int, log=print) -> list[dict]:
    model = load(model_name)
    model.set_attn_implementation("sdpa")
    runs = contenders(model, policies)
    vocab = model.config.get_text_config().vocab_size
    rows = []
    for length in lengths:
        for batch in batches:
            prompt = torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(length))
            for run in runs.values():  # warm-up: first-call allocations and lazy initialisation
                run(prompt[:, :64])
            times = {name: [] for name in runs}
            for _ in range(repeats):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run(prompt)
                    times[name].append(time.perf_counter() - start)
            base = statistics.median(times["transformers-sdpa"])
            for name, ts in times.items():
                rows.append(dict(model=model_name, length=length, batch=batch, contender=name,
                                 median_s=statistics.median(ts), min_s=min(ts), runs=len(ts),
                                 ratio_to_sdpa=statistics.median(ts) / base))
                log(f"{model_name} T={length} B={batch} {name:22s} {statistics.median(ts):7.3f} s "
                    f"({rows[-1]['ratio_to_sdpa']:.2f}x sdpa)")
    return rows


def peak_rss_mib(model_name: str, contender: str, length: int, batch: int) -> float:
    """How far one prefill raises the resident set of a fresh process that loaded the model (MiB): the kernel's
    peak-RSS counter (VmHWM), reset to the current RSS just before the call (/proc/self/clear_refs), minus that
    RSS. Freed heap is handed back to the system first (malloc_trim), so the call cannot hide its peak in memory
    the model load left behind. (A sampling thread, the first way tried, starved the call of the GIL: one
    4096-token H2O prefill ran for 16 minutes.)"""
    code = f"""
import ctypes, sys, torch
sys.path.insert(0, {str(ROOT)!r})
sys.argv = ['x']
from benchmarks.prefill import load, contenders
from h2o_compile.bench.machine import peak_rss_kib, reset_peak_rss
model = load({model_name!r}); model.set_attn_implementation('sdpa')
policies = [{contender.split('-', 1)[1].split('@')[0]!r}] if {contender!r} != 'transformers-sdpa' else []
run = contenders(model, policies)[{contender!r}]
prompt = torch.randint(1, model.config.get_text_config().vocab_size, ({batch}, {length}))
with torch.no_grad():
    run(prompt[:, :64])
    ctypes.CDLL('libc.so.6').malloc_trim(0)
    before = reset_peak_rss()
    if before is None:
        raise SystemExit('no /proc/self/clear_refs here: peak RSS cannot be reset')
    run(prompt)
    peak = peak_rss_kib()
print((peak - before) / 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{contender} at {length} tokens, batch {batch} failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def write_memory_only(model_name: str, lengths, batches, policies, stem: str, command: str) -> int:
    """Peak RSS growth of one prefill per (length, batch, contender), each in a fresh process; no timing."""
    names = ["transformers-sdpa"] + [f"h2o-{spec}@0.2" for spec in policies]
    rows = [dict(model=model_name, length=n, batch=b, contender=name,
                 peak_rss_growth_mib=peak_rss_mib(model_name, name, n, b))
            for n in lengths for b in batches for name in names]
    machine = machine_description()
    write_json(Path(stem + ".json"), dict(command=command, machine=machine, rows=rows))
    table = [[r["length"], r["batch"], r["contender"], f"{r['peak_rss_growth_mib']:.0f}"] for r in rows]
    Path(stem + ".md").write_text(
        f"# Prefill peak memory on CPU: {model_name}\n\n`{command}`\n\nMachine: {machine}. How far one prefill "
        "raises the resident set of a fresh process that loaded the model and ran a 64-token warm-up: the kernel's "
        "peak RSS (VmHWM, reset just before the call) minus the RSS then (after malloc_trim). H2O at budget 0.2 "
        "(reset(batch, prompt + 16), then step(prompt, logits_to_keep=1)); transformers: forward with "
        "use_cache=True, SDPA, logits_to_keep=1, its DynamicCache included.\n\n"
        + markdown_table(["length", "batch", "contender", "peak RSS growth MiB"], table) + "\n")
    print(json.dumps({"wrote": [stem + ".json", stem + ".md"]}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kvbound", choices=("kvbound", "gemma3-270m", "smoke"))
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--policies", default="h2o,sink",
                   help="H2O policies to time (h2o reads the mass, sink not), a policy may carry a score rule: "
                   "h2o+window=64+pool=9")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory", action="store_true", help="also the peak RSS growth of one prefill per contender")
    p.add_argument("--memory-only", action="store_true",
                   help="only the peak RSS growth (no timing; other jobs may run meanwhile)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None, help="output stem (default docs/results/prefill_cpu[_gemma3])")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    policies = args.policies.split(",")
    if args.smoke:
        args.model, lengths, batches, args.repeats = "smoke", [128], [1, 2], 2
    stem = args.out or ("/tmp/h2o_prefill_smoke" if args.smoke else
                        "docs/results/prefill_cpu" + ("_gemma3" if args.model == "gemma3-270m" else ""))
    torch.manual_seed(0)
    command = "python benchmarks/" + command_line().removeprefix("prefill.py").join(["prefill.py", ""])
    if args.memory_only:
        return write_memory_only(args.model, lengths, batches, policies, stem + "_memory", command)
    rows = measure(args.model, lengths, batches, policies, args.repeats)
    if args.memory:
        for row in rows:
            row["peak_rss_growth_mib"] = peak_rss_mib(args.model, row["contender"], row["length"], row["batch"])
    payload = dict(command=command, machine=machine_description(), rows=rows)
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(stem + ".json"), payload)
    headers = ["length", "batch", "contender", "median s", "x transformers SDPA"] + (
        ["peak RSS growth MiB"] if args.memory else [])
    table = [[r["length"], r["batch"], r["contender"], f"{r['median_s']:.3f}", f"{r['ratio_to_sdpa']:.2f}"]
             + ([f"{r['peak_rss_growth_mib']:.0f}"] if args.memory else []) for r in rows]
    Path(stem + ".md").write_text(
        f"# Prefill on CPU: {args.model}\n\n`{command}`\n\nMachine: {payload['machine']}. Median of {args.repeats} "
        "alternating runs per contender; H2O at budget 0.2 (step(prompt, logits_to_keep=1) after reset), "
        "transformers: forward with use_cache=True, SDPA, logits_to_keep=1.\n\n"
        + markdown_table(headers, table) + "\n")
    print(json.dumps({"wrote": [stem + ".json", stem + ".md"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
