"""``h2o-compile``: demo | generate | eval | stream | bench | export."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .config import POLICIES, POSITIONS


def parse_budget(text: str):
    """'0.2' -> 0.2 (fraction), '256' -> 256 (slots)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"budget {text!r} must be a fraction like 0.2 or a slot count like 256") from None


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


def load_local(path: str, dtype: str = "float32"):
    """(model, tokenizer) from a local folder, a local ``.gguf`` file, or a zoo name (``gemma3-270m``,
    ``tiny``); never from a hub."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path)
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    from . import zoo

    if path in zoo.MODELS:
        return zoo.load_model(path, torch_dtype)
    if folder.suffix == ".gguf":
        from .zoo import load_gguf

        if not folder.is_file():
            raise SystemExit(f"error: --model {path!r}: no such .gguf file")
        return load_gguf(folder, torch_dtype)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"error: --model {path!r} is not a folder with a config.json, a .gguf file, or one of "
                         f"{', '.join(zoo.MODELS)} (only local models load)")
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def add_h2o_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=parse_budget, default=0.2, help="fraction of the sequence (0.2) or slots (256)")
    p.add_argument("--policy", choices=POLICIES, default="h2o")
    p.add_argument("--sink-tokens", type=int, default=None)
    p.add_argument("--recent-ratio", type=float, default=0.5)
    p.add_argument("--prefill", type=parse_prefill, default="full", help="'full' or a chunk size")
    p.add_argument("--compress-sliding", action="store_true",
                   help="sliding-window layers under the budget too (default: they keep their window)")


def cmd_generate(args) -> int:
    import torch

    if args.backend == "onnx":
        from .export.ort import H2OOrtModel

        runner = H2OOrtModel.from_pretrained(args.model)
        tokenizer = runner.tokenizer
        if tokenizer is None:
            raise SystemExit(f"error: {args.model} holds no tokenizer files")
        kv_note = f"KV cache (H2O, ONNX Runtime): {human_bytes(runner.kv_cache_bytes())}"
    else:
        import h2o_compile

        model, tokenizer = load_local(args.model, args.dtype)
        runner = h2o_compile.optimize(model, args.budget, recent_ratio=args.recent_ratio,
                                      sink_tokens=args.sink_tokens, policy=args.policy, prefill=args.prefill,
                                      compress_sliding=args.compress_sliding, compile=args.compile)
        kv_note = None
    encoded = tokenizer(args.prompt, return_tensors="pt")
    ids = encoded["input_ids"]
    start = time.perf_counter()
    out = runner.generate(ids, attention_mask=encoded.get("attention_mask"), max_new_tokens=args.max_new_tokens,
                          do_sample=args.temperature > 0, temperature=max(args.temperature, 1e-5),
                          top_k=args.top_k, top_p=args.top_p, generator=torch.Generator().manual_seed(args.seed))
    elapsed = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    print("-" * 60)
    if kv_note is None:
        total = ids.shape[1] + args.max_new_tokens
        kv_note = (f"KV cache: full {human_bytes(runner.full_cache_bytes(1, total))}, transformers' cache "
                   f"{human_bytes(runner.hf_cache_bytes(1, total))}, H2O {human_bytes(runner.kv_cache_bytes())} "
                   f"(capacity {runner.capacity} of {total} tokens, policy {args.policy})")
    print(kv_note)
    print(f"{new} new tokens in {elapsed:.2f} s: {new / elapsed:.1f} tokens/s (prefill included)")
    return 0


def _csv(kind):
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of {kind.__name__}") from None
    return parse


def cmd_eval(args) -> int:
    import torch

    from .quality.report import write_eval_report
    from .quality.evaluation import EvalSettings, evaluate, read_tail

    bad = [p for p in args.policies if p not in POLICIES]
    if bad:
        raise ValueError(f"--policies {bad} not supported; choose from {', '.join(POLICIES)}")
    if "full" in args.policies:
        args.policies = ["full"] + [p for p in args.policies if p != "full"]
    torch.manual_seed(0)
    model, tokenizer = load_local(args.model or "tiny")  # the tiny model is the zoo name "tiny"
    settings = EvalSettings(budgets=args.budgets, policies=args.policies, seq_len=args.seq_len,
                            num_seqs=args.num_seqs, batch_size=args.batch_size, prompt_len=args.prompt_len,
                            gen_prompt_len=args.gen_prompt_len, gen_new_tokens=args.gen_new_tokens,
                            gen_prompts=args.gen_prompts, compile=args.compile != "off",
                            compress_sliding=args.compress_sliding, h2o_sinks=args.h2o_sinks)
    if args.heldout is not None:
        from .zoo.data import read_corpus

        texts = read_corpus(args.text, heldout_frac=args.heldout)[1]
        names = [f"{Path(p).name} (held-out last {args.heldout:.0%}, cleaned as in training)" for p in args.text]
    else:
        texts = [read_tail(path, args.tail) for path in args.text]
        names = [f"{Path(p).name} (last {args.tail:.0%})" for p in args.text]
    start = time.perf_counter()

    def write_partial(partial):  # an interrupted sweep keeps the configurations it finished
        write_eval_report(partial, args.out, model_name=_model_name(args.model), text_names=names,
                          elapsed_s=time.perf_counter() - start)

    result = evaluate(model, tokenizer, texts, settings, on_config=write_partial)
    elapsed = time.perf_counter() - start
    paths = write_eval_report(result, args.out, model_name=_model_name(args.model),
                              text_names=names,
                              elapsed_s=elapsed)
    print(paths["markdown"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def cmd_stream(args) -> int:
    import torch

    from .quality.stream import stream_runs
    from .quality.stream_report import write_stream_report
    from .zoo.data import encode_stream

    for name, values, allowed in (("--policy", args.policy, [p for p in POLICIES if p != "full"]),
                                  ("--positions", args.positions, list(POSITIONS))):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise ValueError(f"{name} {bad or values}: choose from {', '.join(allowed)}")
    model, tokenizer = load_local(args.model)
    texts = []
    for path in args.text:
        texts.append(Path(path).read_text(encoding="utf-8", errors="replace"))
    ids = torch.from_numpy(encode_stream(tokenizer, texts).astype("int64"))
    if args.tokens > ids.numel():
        raise ValueError(f"--tokens {args.tokens:,}: the texts hold {ids.numel():,} tokens; give more --text files "
                         "or fewer tokens")
    ids = ids[:args.tokens]
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    names = [Path(p).name for p in args.text]
    start = time.perf_counter()

    def write(runs):  # after every run, so a long sweep keeps what it finished
        return write_stream_report(runs, args.out, model_name=_model_name(args.model), text_names=names,
                                   max_positions=max_positions, elapsed_s=time.perf_counter() - start)

    runs = stream_runs(model, ids, capacity=args.budget_slots, chunk=args.chunk, policies=args.policy,
                       positions=args.positions, sink_tokens=args.sink_tokens, window_tokens=args.window_tokens,
                       on_run=write)
    paths = write(runs)
    print(paths["markdown"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def _model_name(path) -> str:
    if not path or path == "tiny":
        return "tiny-llama"
    from . import zoo

    return path if path in zoo.MODELS else Path(path).name


def cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(model=args.model, out_dir=args.out, new_tokens=args.max_new_tokens, budget=args.budget)
    return 0


def compile_choice(value: str):
    """A --compile flag as ``optimize(compile=...)`` takes it: on/off -> True/False, a mode name as is."""
    return {"on": True, "off": False}.get(value, value)


def cmd_bench(args) -> int:
    """Decode benchmark vs transformers' caches + roofline; writes <out>.json/.md/.png."""
    import torch

    from .bench.decode import BenchSettings, run_bench
    from .bench.report import write_bench_report
    from .reporting import command_line

    if args.threads:
        torch.set_num_threads(args.threads)
    smoke = dict(models=["smoke"], batches=[1, 2], totals=[64, 128], steps=4, warmup=2, repeats=2,
                 bandwidth_mib=64, quiet_wait_s=0, retries=0) if args.smoke else {}
    settings = BenchSettings(**{**dict(
        models=args.models, batches=args.batches, totals=args.totals, budgets=args.budgets,
        local_budget=args.local_budget, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
        prefill=not args.no_prefill, prefill_repeats=args.prefill_repeats,
        compile=compile_choice(args.compile),
        prefill_contenders=args.prefill_contenders, quiet_wait_s=args.quiet_wait, retries=args.retries,
        contenders=args.contenders, bandwidth_mib=args.bandwidth_mib, seed=args.seed, profile=args.profile),
        **smoke})
    out = args.out or ("/tmp/h2o_bench_smoke/decode_cpu" if args.smoke else "docs/results/decode_cpu")
    result = run_bench(settings)
    command = command_line()
    if command.startswith("decode.py"):  # benchmarks/decode.py, the wrapper
        command = "python benchmarks/" + command
    paths = write_bench_report(result, out, command)
    print(paths["markdown"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="decode tokens/s, latency, memory vs transformers' caches + roofline")
    bench.add_argument("--models", type=_csv(str), default=["tiny", "kvbound"], help="tiny,kvbound (or smoke)")
    bench.add_argument("--batches", type=_csv(int), default=[1, 8])
    bench.add_argument("--totals", type=_csv(int), default=[1024, 4096], help="prompt + generated tokens")
    bench.add_argument("--budgets", type=_csv(float), default=[0.1, 0.2, 0.5], help="h2o budgets")
    bench.add_argument("--local-budget", type=float, default=0.2)
    bench.add_argument("--steps", type=int, default=16, help="timed decode steps per block")
    bench.add_argument("--warmup", type=int, default=3, help="untimed decode steps (compile included)")
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--no-prefill", action="store_true", help="skip the batch-1 prefill timing")
    bench.add_argument("--prefill-repeats", type=int, default=1)
    bench.add_argument("--prefill-contenders", type=_csv(str),
                       default=["hf-dynamic", "hf-static-compile", "h2o-full", "h2o@0.2"],
                       help="contenders whose batch-1 prefill is timed ('' = all)")
    bench.add_argument("--compile", choices=("on", "off", "max-autotune"), default="on",
                       help="compiled contenders: torch.compile default mode, eager, or max-autotune (CPU: with "
                            "frozen, prepacked weights) for transformers' StaticCache and H2O alike")
    bench.add_argument("--contenders", type=_csv(str), default=None,
                       help="subset, e.g. hf-dynamic,hf-static-compile,h2o-full,local@0.2,h2o@0.2")
    bench.add_argument("--bandwidth-mib", type=int, default=512)
    bench.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--profile", action="store_true", help="torch.profiler tables at the largest config")
    bench.add_argument("--quiet-wait", type=float, default=900.0,
                       help="max seconds to wait, before each measurement, for other processes to leave the CPU")
    bench.add_argument("--retries", type=int, default=2, help="redo a decode configuration others disturbed")
    bench.add_argument("--smoke", action="store_true", help="tiny sizes, to check it works (output in /tmp)")
    bench.add_argument("--out", default=None, help="path without extension (default docs/results/decode_cpu)")
    bench.set_defaults(func=cmd_bench)


def cmd_export(args) -> int:
    from .export import export_onnx

    model, tokenizer = load_local(args.model, args.dtype)
    out = export_onnx(model, args.output, budget=args.budget, max_seq_len=args.max_seq_len,
                      batch_size=args.batch_size, policy=args.policy, recent_ratio=args.recent_ratio,
                      sink_tokens=args.sink_tokens, prefill=args.prefill, compress_sliding=args.compress_sliding,
                      opset=args.opset, tokenizer=tokenizer)
    print(f"wrote {out} (model.onnx, h2o_config.json, config + tokenizer)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="h2o-compile", description="H2O KV-cache eviction for Hugging Face LMs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with an H2O cache from a local model folder")
    gen.add_argument("model", nargs="?", help="model folder (or the exported folder with --backend onnx)")
    gen.add_argument("--model", dest="model_opt", help="model folder, .gguf file, or gemma3-270m / tiny")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    gen.add_argument("--backend", choices=("torch", "onnx"), default="torch")
    gen.add_argument("--compile", choices=("auto", "on", "off", "reduce-overhead", "max-autotune"), default="auto",
                     help="decode step under torch.compile: auto = on CUDA only; or a torch.compile mode "
                          "(max-autotune on CPU also freezes and prepacks the weights)")
    add_h2o_args(gen)
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="perplexity and generation agreement vs budget, per policy")
    ev.add_argument("--model", default=None, help="model folder, .gguf file, or gemma3-270m / tiny (default: tiny)")
    ev.add_argument("--text", nargs="+", required=True, help="text file(s) to evaluate on")
    ev.add_argument("--tail", type=float, default=1.0, help="use only the last fraction of each file (0.1)")
    ev.add_argument("--heldout", type=float, default=None,
                    help="use the held-out tail exactly as the shipped model's trainer split it (e.g. 0.1)")
    ev.add_argument("--budgets", type=_csv(float), default=[0.05, 0.1, 0.2, 0.5, 1.0],
                    help="comma-separated fractions of the sequence kept (0.05,0.1,0.2,0.5,1.0)")
    ev.add_argument("--policies", type=_csv(str), default=["full", "h2o", "local", "sink", "random"],
                    help="comma-separated, from full, h2o, local, sink, random (all)")
    ev.add_argument("--seq-len", type=int, default=1024, help="tokens per perplexity window (1024)")
    ev.add_argument("--num-seqs", type=int, default=8, help="perplexity windows (8; 0: generation agreement only)")
    ev.add_argument("--batch-size", type=int, default=8, help="windows run together (8)")
    ev.add_argument("--prompt-len", type=int, default=32,
                    help="tokens fed as one block before the scored one-token steps (32)")
    ev.add_argument("--gen-prompt-len", type=int, default=896, help="prompt tokens for generation agreement (896)")
    ev.add_argument("--gen-new-tokens", type=int, default=128, help="greedy tokens compared with the full cache (128)")
    ev.add_argument("--gen-prompts", type=int, default=8, help="prompts for generation agreement (8)")
    ev.add_argument("--compile", choices=("on", "off"), default="on", help="torch.compile the decode step (on)")
    ev.add_argument("--compress-sliding", action="store_true",
                    help="compress sliding-window layers to the budget too (default: they keep their window)")
    ev.add_argument("--h2o-sinks", type=int, default=0, help="also evaluate h2o with this many sink tokens")
    ev.add_argument("--out", default="docs/results/eval", help="folder for eval.json / .md / .png")
    ev.set_defaults(func=cmd_eval)

    st = sub.add_parser("stream", help="one long stream through a fixed-size cache: perplexity and memory along it")
    st.add_argument("--model", default="tiny", help="model folder, .gguf file, or gemma3-270m / tiny (default)")
    st.add_argument("--text", nargs="+", required=True, help="text file(s), concatenated into one stream")
    st.add_argument("--tokens", type=int, required=True, help="stream length in tokens")
    st.add_argument("--budget-slots", type=int, required=True, help="cache slots C per layer and KV head")
    st.add_argument("--chunk", type=int, default=64, help="tokens per step (memory: C + chunk)")
    st.add_argument("--policy", type=_csv(str), default=["h2o", "sink"], help="comma-separated (h2o,sink)")
    st.add_argument("--positions", type=_csv(str), default=["rolling"], help="rolling and/or true")
    st.add_argument("--sink-tokens", type=int, default=None, help="default: 0 for h2o, 4 for sink")
    st.add_argument("--window-tokens", type=int, default=4096, help="scored tokens per reported window")
    st.add_argument("--out", default="docs/results/stream")
    st.set_defaults(func=cmd_stream)

    exp = sub.add_parser("export", help="export an H2O model to ONNX for ONNX Runtime")
    exp.add_argument("--model", required=True, help="model folder, .gguf file, or gemma3-270m / tiny")
    exp.add_argument("-o", "--output", required=True, help="output folder")
    add_h2o_args(exp)
    exp.add_argument("--max-seq-len", type=int, default=None,
                     help="prompt + new tokens the export serves (default min(2048, max positions))")
    exp.add_argument("--batch-size", type=int, default=None, help="fix the batch size (default: dynamic)")
    exp.add_argument("--opset", type=int, default=18)
    exp.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    exp.set_defaults(func=cmd_export)

    demo = sub.add_parser("demo", help="offline demo: Gemma 3 270M (or the tiny model), full cache vs H2O at 20%%")
    demo.add_argument("--model", default="gemma3-270m", help="gemma3-270m (default; the gemma extra) or tiny")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--budget", type=float, default=0.2)
    demo.add_argument("--out", default=None, help="folder for demo.md / .json / .png (default: print only)")
    demo.set_defaults(func=cmd_demo)

    add_bench_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "command", None) == "generate":
        args.model = args.model_opt or args.model
        if not args.model:
            parser.error("generate needs a model folder (--model PATH)")
        args.compile = compile_choice(args.compile)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as err:
        # What the library raises for bad input, a missing file or a missing extra: one line, no stack trace.
        # Anything else (a TypeError included) is a bug and keeps its traceback.
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
