"""``h2o-compile``: demo | generate | export | eval | eval-merge | stream | tasks | tasks-merge | calibrate | serve |
bench (the quality commands live in cli/quality_commands.py; the shared flag vocabulary in cli/arguments.py)."""

from __future__ import annotations

import argparse
from importlib.metadata import version
import sys
import time

from .arguments import (COMPILE_CHOICES, COMPILE_HELP, MODEL_HELP, Parser, add_config_args, compile_choice,
                        config_from_args, csv_of, default_out, parse_budget, require)
from ..config import POLICIES
from ..reporting import command_line, print_report
from ..zoo.loading import load_pretrained
from ..runtime import optimize
from .calibrate import add_calibrate_parser
from .demo import run_demo
from .serve import add_serve_parser
from ..bench.decode import BenchSettings, run_bench
from ..bench.report import write_bench_report
from ..export import H2OOrtModel, export_onnx
from .quality_commands import add_quality_parsers


def parse_prefill(text: str):
    if text == "full":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"prefill {text!r} must be 'full' or an int chunk size") from None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def add_h2o_args(p: argparse.ArgumentParser) -> None:
    """--preset / --rule, --budget and the single fields a command line sets most; an unset flag keeps the
    preset's value."""
    add_config_args(p)
    p.add_argument("--budget", type=parse_budget, default=None,
                   help="fraction of the sequence (0.2) or cache slots (256); default: the preset's, 0.2")
    p.add_argument("--policy", choices=POLICIES, default=None, help="eviction policy (default: the preset's)")
    p.add_argument("--sink-tokens", type=int, default=None, help="default: the policy's (0; sink: 4)")
    p.add_argument("--recent-ratio", type=float, default=None, help="the recent window's share (default: the preset's)")
    p.add_argument("--prefill", type=parse_prefill, default=None, help="'full' or a chunk size (default: full)")
    p.add_argument("--compress-sliding", action="store_true", default=None,
                   help="sliding-window layers under the budget too (default: they keep their window)")
    p.add_argument("--kv-dtype", choices=("model", "int8"), default=None,
                   help="kept keys and values in the model's dtype, or int8 with one scale per vector")


def config_of(args):
    """The H2OConfig that --preset / --rule and the single flags say."""
    return config_from_args(args, budget=args.budget, policy=args.policy, sink_tokens=args.sink_tokens,
                            recent_ratio=args.recent_ratio, prefill=args.prefill,
                            compress_sliding=args.compress_sliding, kv_dtype=args.kv_dtype)


def cmd_generate(args) -> int:
    import torch

    from transformers import TextStreamer

    if args.backend == "onnx":
        require("generate --backend onnx", "onnx", "onnxruntime")
        runner = H2OOrtModel.from_pretrained(args.model, native=True if args.native else "auto")
        tokenizer = runner.tokenizer
        if tokenizer is None:
            raise SystemExit(f"error: {args.model} holds no tokenizer files")
        op = "native op" if runner.native else "ONNX function"
        kv_note = f"KV cache (H2O, ONNX Runtime, {op}): {human_bytes(runner.kv_cache_bytes())}"
    else:
        config = config_of(args)  # a bad configuration fails before the model loads
        model, tokenizer = load_pretrained(args.model, args.dtype)
        runner = optimize(model, config=config, compile=args.compile)
        kv_note = None
    encoded = tokenizer(args.prompt, return_tensors="pt")
    ids = encoded["input_ids"]
    start = time.perf_counter()
    # --temperature 0 is greedy whatever the model's generation_config says; top-k / top-p left unset keep
    # the model's defaults (transformers' top_k=50 when it sets none), as transformers' generate does.
    sampling = dict(do_sample=False)
    if args.temperature > 0:
        sampling = dict(do_sample=True, temperature=args.temperature)
        sampling.update({k: v for k, v in (("top_k", args.top_k), ("top_p", args.top_p)) if v is not None})
    torch.manual_seed(args.seed)  # generate samples from torch's global generator, as transformers does
    streamer = TextStreamer(tokenizer, skip_special_tokens=True)  # prints the prompt, then each word as it comes
    out = runner.generate(ids, attention_mask=encoded.get("attention_mask"), max_new_tokens=args.max_new_tokens,
                          streamer=streamer, **sampling)
    elapsed = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    print("-" * 60)
    if kv_note is None:
        total = ids.shape[1] + args.max_new_tokens
        kv_note = (f"KV cache: full {human_bytes(runner.full_cache_bytes(1, total))}, transformers' cache "
                   f"{human_bytes(runner.hf_cache_bytes(1, total))}, H2O {human_bytes(runner.kv_cache_bytes())} "
                   f"(capacity {runner.stream.capacity} of {total} tokens, policy {config.policy})")
    print(kv_note)
    print(f"{new} new tokens in {elapsed:.2f} s: {new / elapsed:.1f} tokens/s (prefill included)")
    return 0


def cmd_demo(args) -> int:
    if args.out:
        require("demo --out", "matplotlib")
    run_demo(model=args.model, out_dir=args.out, new_tokens=args.max_new_tokens, budget=args.budget)
    return 0


def cmd_bench(args) -> int:
    """Decode benchmark vs transformers' caches + roofline; writes <out>.json/.md/.png."""
    import torch

    require("bench", "matplotlib")
    if args.threads:
        torch.set_num_threads(args.threads)
    smoke = dict(models=["smoke"], batches=[1, 2], totals=[64, 128], steps=4, warmup=2, repeats=2,
                 bandwidth_mib=64, quiet_wait_s=0, retries=0) if args.smoke else {}
    settings = BenchSettings(**{**dict(
        models=args.models, batches=args.batches, totals=args.totals, budgets=args.budgets,
        local_budget=args.local_budget, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
        prefill=not args.no_prefill, prefill_repeats=args.prefill_repeats,
        compile=True if args.compile == "auto" else compile_choice(args.compile),  # a benchmark's compiled rows
        prefill_contenders=args.prefill_contenders, quiet_wait_s=args.quiet_wait, retries=args.retries,
        contenders=args.contenders, bandwidth_mib=args.bandwidth_mib, seed=args.seed, profile=args.profile),
        **smoke})
    out = args.out or str(default_out("bench") / "decode")
    result = run_bench(settings)
    command = command_line()
    if command.startswith("decode.py"):  # benchmarks/decode.py, the wrapper
        command = "python benchmarks/" + command
    paths = write_bench_report(result, out, command)
    print_report(paths)
    return 0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="decode tokens/s, latency, memory vs transformers' caches + roofline")
    bench.add_argument("--model", "--models", dest="models", type=csv_of(str), default=["tiny", "kvbound"],
                       help="models, comma-separated: kvbound (a KV-bound random Llama), smoke, a shipped "
                            "model (tiny, gemma3-270m), a local folder or a .gguf file (measured locally)")
    bench.add_argument("--batches", type=csv_of(int), default=[1, 8])
    bench.add_argument("--totals", type=csv_of(int), default=[1024, 4096], help="prompt + generated tokens")
    bench.add_argument("--budget", "--budgets", dest="budgets", type=csv_of(parse_budget), default=[0.1, 0.2, 0.5],
                       help="h2o budgets, comma-separated")
    bench.add_argument("--local-budget", type=float, default=0.2)
    bench.add_argument("--steps", type=int, default=16, help="timed decode steps per block")
    bench.add_argument("--warmup", type=int, default=3, help="untimed decode steps (compile included)")
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--no-prefill", action="store_true", help="skip the batch-1 prefill timing")
    bench.add_argument("--prefill-repeats", type=int, default=1)
    bench.add_argument("--prefill-contenders", type=csv_of(str),
                       default=["hf-dynamic", "hf-static-compile", "h2o-full", "h2o@0.2"],
                       help="contenders whose batch-1 prefill is timed ('' = all)")
    bench.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                       help="the compiled contenders (transformers' StaticCache and H2O alike; auto and on compile "
                            "them on any device): " + COMPILE_HELP)
    bench.add_argument("--contenders", type=csv_of(str), default=None,
                       help="subset, e.g. hf-dynamic,hf-static-compile,h2o-full,local@0.2,h2o@0.2")
    bench.add_argument("--bandwidth-mib", type=int, default=512)
    bench.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--profile", action="store_true", help="torch.profiler tables at the largest config")
    bench.add_argument("--quiet-wait", type=float, default=900.0,
                       help="max seconds to wait, before each measurement, for other processes to leave the CPU")
    bench.add_argument("--retries", type=int, default=2, help="redo a decode configuration others disturbed")
    bench.add_argument("--smoke", action="store_true", help="tiny sizes, to check it works")
    bench.add_argument("--out", default=None, help="path without extension (default: runs/bench-<time>/decode)")
    bench.set_defaults(func=cmd_bench)


def cmd_export(args) -> int:
    require("export", "onnx", "onnxscript")
    config = config_of(args)  # a bad configuration fails before the model loads
    model, tokenizer = load_pretrained(args.model, args.dtype)
    out = export_onnx(model, args.out or default_out("export"), config=config, max_seq_len=args.max_seq_len,
                      batch_size=args.batch_size, opset=args.opset, tokenizer=tokenizer, op=args.op)
    print(f"wrote {out} (model.onnx, h2o_config.json, config + tokenizer)")
    return 0


def add_export_args(exp: argparse.ArgumentParser) -> None:
    """The flags of ``h2o-compile export``, which ``optimum-cli export h2o`` takes too (integrations/optimum)."""
    exp.add_argument("--model", required=True, help=MODEL_HELP)
    exp.add_argument("--out", "-o", "--output", dest="out", default=None,
                     help="output folder (default: runs/export-<time>)")
    add_h2o_args(exp)
    exp.add_argument("--max-seq-len", type=int, default=None,
                     help="prompt + new tokens the export serves (default min(2048, max positions))")
    exp.add_argument("--batch-size", type=int, default=None, help="fix the batch size (default: dynamic)")
    exp.add_argument("--opset", type=int, default=18)
    exp.add_argument("--op", choices=("function", "native"), default="function",
                     help="function: H2OAttention with its ONNX function body (runs anywhere; the native op is "
                          "chosen at load time when available); native: no body, needs the native op")
    exp.add_argument("--dtype", choices=("float32", "float16"), default="float32")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="h2o-compile", description="H2O KV-cache eviction for Hugging Face causal LMs")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('h2o-compile')}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    gen = sub.add_parser("generate", help="generate text with an H2O cache, streaming tokens as they come")
    gen.add_argument("--model", required=True, help=MODEL_HELP + " (with --backend onnx: an exported folder)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=None, help="when sampling (default: the model's, else 50)")
    gen.add_argument("--top-p", type=float, default=None, help="when sampling (default: the model's, else 1.0)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    gen.add_argument("--backend", choices=("torch", "onnx"), default="torch",
                     help="torch: optimize() the model; onnx: run a folder written by h2o-compile export")
    gen.add_argument("--native", action="store_true",
                     help="with --backend onnx: require the native H2OAttention op (compiled on first use; "
                          "default: used when it builds)")
    gen.add_argument("--compile", choices=COMPILE_CHOICES, default="auto", help=COMPILE_HELP)
    add_h2o_args(gen)
    gen.set_defaults(func=cmd_generate)

    exp = sub.add_parser("export", help="export an H2O model to ONNX for ONNX Runtime")
    add_export_args(exp)
    exp.set_defaults(func=cmd_export)

    demo = sub.add_parser("demo", help="offline demo: Gemma 3 270M (or the tiny model), full cache vs H2O at 20%%")
    demo.add_argument("--model", default="gemma3-270m", help=MODEL_HELP + " (gemma3-270m: the gemma extra)")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--budget", type=parse_budget, default=0.2, help="fraction of the sequence kept, or slots")
    demo.add_argument("--out", default=None, help="folder for demo.md / .json / .png (default: print only)")
    demo.set_defaults(func=cmd_demo)

    add_quality_parsers(sub)
    add_calibrate_parser(sub, add_h2o_args, config_of)
    add_serve_parser(sub, add_h2o_args, config_of)
    add_bench_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "compile") and args.command == "generate":
        args.compile = compile_choice(args.compile)
    return run_command(args.func, args)


def run_command(func, args) -> int:
    """``func(args)``, the exit code; what the library raises for bad input, a missing file or a missing extra is
    one line on stderr (exit code 2), not a traceback."""
    try:
        return func(args)
    except (ValueError, FileNotFoundError, ImportError) as err:
        # What the library raises for bad input, a missing file or a missing extra: one line, no stack trace.
        # Anything else (a TypeError included) is a bug and keeps its traceback.
        print(f"error: {err}", file=sys.stderr)
        return 2

