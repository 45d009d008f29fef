"""The quality commands of ``h2o-compile``: eval (budget sweep), eval-merge (one report from split sweeps),
stream (one long stream through a fixed cache), tasks (long-context retrieval) and tasks-merge."""

from __future__ import annotations

import time
from pathlib import Path

from .arguments import (COMPILE_CHOICES, COMPILE_HELP, MODEL_HELP, compile_choice, csv_of, default_out,
                        parse_budget, require)
from ..config import H2OConfig, POLICIES, POSITIONS
from ..reporting import print_report
from ..zoo.loading import load_pretrained, model_name
from ..quality.report import write_eval_report
from ..quality.evaluation import EvalSettings, evaluate, read_tail
from ..zoo.data import clean_text, encode_stream, read_corpus
from ..quality.stream import stream_rule_options, stream_runs
from ..quality.stream_report import write_stream_report
from ..quality.merge import load_run, merge_runs
from ..kernels.quantized import check_kv_dtype
from ..quality.task_eval import run_tasks, TaskConfig
from ..quality.task_report import write_task_report
from ..quality.tasks import make_samples, TASKS, write_samples
from ..quality.task_merge import merge_task_runs


def cmd_eval(args) -> int:
    require("eval", "matplotlib")
    args.out = args.out or str(default_out("eval"))
    import torch

    bad = [p for p in args.policies if p not in POLICIES]
    if bad:
        raise ValueError(f"--policy {bad} not supported; choose from {', '.join(POLICIES)}")
    if "full" in args.policies:
        args.policies = ["full"] + [p for p in args.policies if p != "full"]
    settings = EvalSettings(budgets=args.budgets, policies=args.policies, seq_len=args.seq_len,
                            num_seqs=args.num_seqs, batch_size=args.batch_size, prompt_len=args.prompt_len,
                            gen_prompt_len=args.gen_prompt_len, gen_new_tokens=args.gen_new_tokens,
                            gen_prompts=args.gen_prompts, compile=compile_choice(args.compile),
                            compress_sliding=args.compress_sliding, h2o_sinks=args.h2o_sinks,
                            h2o_rules=args.h2o_rules, kv_dtypes=args.kv_dtypes)  # its checks, before the model loads
    torch.manual_seed(0)
    model, tokenizer = load_pretrained(args.model)
    if args.heldout is not None:
        texts = read_corpus(args.text, heldout_frac=args.heldout)[1]
        names = [f"{Path(p).name} (held-out last {args.heldout:.0%}, cleaned as in training)" for p in args.text]
    else:
        texts = [read_tail(path, args.tail) for path in args.text]
        names = [f"{Path(p).name} (last {args.tail:.0%})" for p in args.text]
    start = time.perf_counter()

    def write_partial(partial):  # an interrupted sweep keeps the configurations it finished
        write_eval_report(partial, args.out, model_name=model_name(args.model), text_names=names,
                          elapsed_s=time.perf_counter() - start)

    result = evaluate(model, tokenizer, texts, settings, on_config=write_partial)
    elapsed = time.perf_counter() - start
    paths = write_eval_report(result, args.out, model_name=model_name(args.model),
                              text_names=names,
                              elapsed_s=elapsed)
    print_report(paths)
    return 0


def cmd_stream(args) -> int:
    require("stream", "matplotlib")
    args.out = args.out or str(default_out("stream"))
    import torch

    if not isinstance(args.budget_slots, int):
        raise ValueError(f"--budget {args.budget_slots}: a stream has no length to take a fraction of; give its "
                         "cache slots, an int such as 512")
    for name, values, allowed in (("--policy", args.policy, [p for p in POLICIES if p != "full"]),
                                  ("--positions", args.positions, list(POSITIONS))):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise ValueError(f"{name} {bad or values}: choose from {', '.join(allowed)}")
    for rule in args.rules:  # a bad rule fails before the model loads
        options = stream_rule_options(rule, args.compress_sliding)
        H2OConfig.from_options(dict(compress_sliding=args.compress_sliding, **options))
    H2OConfig(recent_ratio=args.recent_ratio)  # H2OConfig's own check, before the model loads
    if args.max_distance is not None:
        if "capped" not in args.positions:
            raise ValueError(f"--max-distance {args.max_distance} caps --positions capped, which is not among "
                             f"{','.join(args.positions)}")
        H2OConfig(positions="capped", max_distance=args.max_distance)
    model, tokenizer = load_pretrained(args.model)
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
        return write_stream_report(runs, args.out, model_name=model_name(args.model), text_names=names,
                                   max_positions=max_positions, elapsed_s=time.perf_counter() - start)

    runs = stream_runs(model, ids, capacity=args.budget_slots, chunk=args.chunk, policies=args.policy,
                       positions=args.positions, sink_tokens=args.sink_tokens, window_tokens=args.window_tokens,
                       rules=args.rules, recent_ratio=args.recent_ratio, on_run=write,
                       max_distance=args.max_distance, compress_sliding=args.compress_sliding)
    paths = write(runs)
    print_report(paths)
    return 0


def cmd_eval_merge(args) -> int:
    require("eval-merge", "matplotlib")
    args.out = args.out or str(default_out("eval-merge"))
    out = Path(args.out).resolve()
    if any(Path(folder).resolve() == out for folder in args.runs):
        raise ValueError(f"--out {args.out} is one of the runs to merge: it would overwrite that run's report")
    runs = [load_run(folder) for folder in args.runs]
    result = merge_runs(runs)
    paths = write_eval_report(result, args.out, model_name=runs[0]["model"], text_names=runs[0]["texts"],
                              elapsed_s=sum(run.get("elapsed_s", 0.0) for run in runs), sources=runs)
    print_report(paths)
    return 0


def cmd_tasks(args) -> int:
    """Retrieval tasks (quality/tasks.py) under every configuration; tasks.json / .md / plots in --out."""
    require("tasks", "matplotlib")
    args.out = args.out or str(default_out("tasks"))
    import torch

    bad = [t for t in args.tasks if t not in TASKS]
    if bad:
        raise ValueError(f"--tasks {bad}; choose from {', '.join(TASKS)}")
    bad = [p for p in args.policies if p not in POLICIES or p == "full"]
    if bad:
        raise ValueError(f"--policy {bad}; choose from {', '.join(p for p in POLICIES if p != 'full')} "
                         "(the full cache is always run unless --no-full)")
    for rule in args.rules:
        # A bad rule (or one with recent=, or global= without --compress-sliding) fails before the model loads.
        H2OConfig.from_options(TaskConfig("h2o", rule=rule, compress_sliding=args.compress_sliding).optimize_kwargs())
    for kv_dtype in args.kv_dtypes:
        check_kv_dtype(kv_dtype)
    part = parse_part(args.part, args.samples)
    torch.manual_seed(0)
    model, tokenizer = load_pretrained(args.model)
    text = "\n".join(clean_text(Path(p).read_text(encoding="utf-8")) for p in args.text)
    filler = tokenizer(text, add_special_tokens=False)["input_ids"]
    samples = [s for task in args.tasks for n in args.lengths
               for s in make_samples(task, tokenizer, filler, n, args.samples, seed=args.seed)
               if s.index in part]
    # The task file: the exact prompts and answers, for another program (benchmarks/kvpress_tasks.py).
    write_samples(Path(args.out) / "samples.jsonl", samples, tokenizer, seed=args.seed)
    configs = [] if args.no_full else [TaskConfig("full")]
    for kv_dtype in args.kv_dtypes:
        for budget in args.budgets:
            for policy in args.policies:
                for rule in (args.rules if policy == "h2o" else ["sum"]):
                    for ratio in args.recent_ratios:
                        configs.append(TaskConfig(policy, budget, rule, args.compress_sliding, args.sink_tokens,
                                                  ratio, kv_dtype))
    settings = dict(tasks=args.tasks, lengths=args.lengths, samples=args.samples, seed=args.seed,
                    budgets=args.budgets, policies=args.policies, rules=args.rules,
                    compress_sliding=args.compress_sliding, sink_tokens=args.sink_tokens,
                    recent_ratios=args.recent_ratios, kv_dtypes=args.kv_dtypes, part=_part_setting(part),
                    filler=[Path(p).name for p in args.text])

    def write_partial(run):  # an interrupted run keeps the configurations it finished
        write_task_report(run, args.out, model_name=model_name(args.model), settings=settings)

    run = run_tasks(model, tokenizer, samples, configs, on_config=write_partial)
    print_report(write_task_report(run, args.out, model_name=model_name(args.model), settings=settings))
    return 0


def parse_part(text, samples: int) -> range:
    """--part 'START:STOP[:STEP]' -> the sample indices range(START, STOP, STEP) of the --samples grid this run
    takes (None: all of them), so a run split in parts measures the samples one whole run would, and a STEP
    picks the subset another program scored (``benchmarks/kvpress_tasks.py --every 5`` is '0:50:5')."""
    if text is None:
        return range(samples)
    fields = text.split(":")
    try:
        start, stop, step = (int(fields[0] or 0), int(fields[1]) if fields[1] else samples,
                             int(fields[2]) if len(fields) == 3 and fields[2] else 1)
        part = range(start, stop, step) if len(fields) <= 3 else None
    except (ValueError, IndexError):
        part = None
    if part is None or not 0 <= part.start < part.stop <= samples or part.step < 1:
        raise ValueError(f"--part {text!r} must be START:STOP or START:STOP:STEP with 0 <= START < STOP <= "
                         f"--samples ({samples}) and STEP >= 1")
    return part


def _part_setting(part: range) -> list[int]:
    """[START, STOP] as the settings always recorded it, [START, STOP, STEP] when a step was given."""
    return [part.start, part.stop] + ([part.step] if part.step != 1 else [])


def cmd_tasks_merge(args) -> int:
    require("tasks-merge", "matplotlib")
    if args.out is None and len(args.runs) > 1 and not (Path(args.runs[0]) / "tasks.json").is_file():
        args.out, args.runs = args.runs[0], args.runs[1:]  # the older form: tasks-merge OUT RUNS...
    repeated = sorted({run for run in args.runs if args.runs.count(run) > 1})
    if repeated:
        raise ValueError(f"tasks-merge: run folder {repeated[0]!r} given twice; each run is merged once")
    if args.out is not None and any(Path(run).resolve() == Path(args.out).resolve() for run in args.runs):
        raise ValueError(f"tasks-merge: --out {args.out!r} is one of the runs; merging would overwrite it")
    args.out = args.out or str(default_out("tasks-merge"))
    print_report(merge_task_runs(args.runs, args.out))
    return 0


def add_quality_parsers(sub) -> None:
    ev = sub.add_parser("eval", help="perplexity and generation agreement vs budget, per policy")
    ev.add_argument("--model", default="tiny", help=MODEL_HELP)
    ev.add_argument("--text", nargs="+", required=True, help="text file(s) to evaluate on")
    ev.add_argument("--tail", type=float, default=1.0, help="use only the last fraction of each file, e.g. 0.1")
    ev.add_argument("--heldout", type=float, default=None,
                    help="use the held-out tail exactly as the shipped model's trainer split it (e.g. 0.1)")
    ev.add_argument("--budget", "--budgets", dest="budgets", type=csv_of(parse_budget),
                    default=[0.05, 0.1, 0.2, 0.5, 1.0],
                    help="comma-separated fractions of the sequence kept (0.2) or cache slots (256)")
    ev.add_argument("--policy", "--policies", dest="policies", type=csv_of(str),
                    default=["full", "h2o", "local", "sink", "random"],
                    help="comma-separated, from full, h2o, local, sink, random")
    ev.add_argument("--seq-len", type=int, default=1024, help="tokens per perplexity window")
    ev.add_argument("--num-seqs", type=int, default=8, help="perplexity windows (0: generation agreement only)")
    ev.add_argument("--batch-size", type=int, default=8, help="windows run together")
    ev.add_argument("--prompt-len", type=int, default=32,
                    help="tokens fed as one block before the scored one-token steps")
    ev.add_argument("--gen-prompt-len", type=int, default=896, help="prompt tokens for generation agreement")
    ev.add_argument("--gen-new-tokens", type=int, default=128, help="greedy tokens compared with the full cache")
    ev.add_argument("--gen-prompts", type=int, default=8, help="prompts for generation agreement")
    ev.add_argument("--compile", choices=COMPILE_CHOICES, default="auto", help=COMPILE_HELP)
    ev.add_argument("--compress-sliding", action="store_true",
                    help="compress sliding-window layers to the budget too (default: they keep their window)")
    ev.add_argument("--sink-tokens", "--h2o-sinks", dest="h2o_sinks", type=int, default=0,
                    help="also evaluate h2o with this many sink tokens")
    ev.add_argument("--rule", "--rules", "--h2o-rules", "--preset", dest="h2o_rules", type=csv_of(str), default=[],
                    help="also evaluate h2o under these rules, comma-separated, each in the rule syntax "
                         "(H2OConfig.parse): presets, mean, max, tova, snapkv, decay=G, window=W, "
                         "pool=K, recent=R (the recent window's share), global=S (full-attention layers' share of "
                         "the slots, with --compress-sliding), sliding=SCORE (the sliding-window layers' own score, "
                         "with --compress-sliding), joined by '+'")
    ev.add_argument("--kv-dtype", "--kv-dtypes", dest="kv_dtypes", type=csv_of(str), default=["model"],
                    help="entry dtypes, each configuration once per dtype: model, int8; int8 rows are "
                         "labelled <policy>+int8")
    ev.add_argument("--out", default=None, help="folder for eval.json / .md / .png (default: runs/eval-<time>)")
    ev.set_defaults(func=cmd_eval)

    merge = sub.add_parser("eval-merge", help="one report (table, plot) from eval runs of the same measurement")
    merge.add_argument("runs", nargs="+", help="folders written by h2o-compile eval --out")
    merge.add_argument("--out", default=None, help="folder for the merged report (default: runs/eval-merge-<time>)")
    merge.set_defaults(func=cmd_eval_merge)

    st = sub.add_parser("stream", help="one long stream through a fixed-size cache: perplexity and memory along it")
    st.add_argument("--model", default="tiny", help=MODEL_HELP)
    st.add_argument("--text", nargs="+", required=True, help="text file(s), concatenated into one stream")
    st.add_argument("--tokens", type=int, required=True, help="stream length in tokens")
    st.add_argument("--budget", "--budget-slots", dest="budget_slots", type=parse_budget, required=True,
                    help="cache slots C per layer and KV head (a stream has no end, so a number of slots)")
    st.add_argument("--chunk", type=int, default=64, help="tokens per step (memory: C + chunk)")
    st.add_argument("--policy", type=csv_of(str), default=["h2o", "sink"], help="comma-separated")
    st.add_argument("--positions", type=csv_of(str), default=["rolling"],
                    help="comma-separated from rolling (rank in the cache), capped (true distance up to "
                         "--max-distance), true")
    st.add_argument("--max-distance", type=int, default=None,
                    help="the cap of --positions capped (default: half the model's max_position_embeddings)")
    st.add_argument("--sink-tokens", type=int, default=None, help="default: 0 for h2o, 4 for sink")
    st.add_argument("--window-tokens", type=int, default=4096, help="scored tokens per reported window")
    st.add_argument("--rule", "--rules", "--preset", dest="rules", type=csv_of(str), default=["sum"],
                    help="h2o score rules, one run each: sum, mean, max, tova, decay=G, global=S and "
                         "sliding=SCORE (with --compress-sliding), joined by '+' (sum); no prompt rules (window=, "
                         "pool=, snapkv): a stream has no prompt")
    st.add_argument("--recent-ratio", type=float, default=0.5, help="share of the cache for recent tokens")
    st.add_argument("--compress-sliding", action="store_true",
                    help="sliding-window layers under the policy too, min(C, W) slots (default: they keep their "
                         "window); needed by rules with global=S")
    st.add_argument("--out", default=None, help="folder for stream.json / .md / .png (default: runs/stream-<time>)")
    st.set_defaults(func=cmd_stream)

    tk = sub.add_parser("tasks", help="long-context retrieval (pass key, multi-key, variable tracking) vs budget")
    tk.add_argument("--model", default="tiny", help=MODEL_HELP)
    tk.add_argument("--tasks", type=csv_of(str), default=["passkey"], help="comma-separated: passkey,multikey,vartrack")
    tk.add_argument("--lengths", type=csv_of(int), default=[2048, 4096], help="prompt tokens")
    tk.add_argument("--samples", type=int, default=50, help="prompts per task and length")
    tk.add_argument("--budget", "--budgets", dest="budgets", type=csv_of(parse_budget), default=[0.1, 0.2, 0.5],
                    help="fractions kept, comma-separated")
    tk.add_argument("--policy", "--policies", dest="policies", type=csv_of(str), default=["h2o", "sink", "local"],
                    help="comma-separated, from h2o, local, sink, random")
    tk.add_argument("--rule", "--rules", "--preset", dest="rules", type=csv_of(str), default=["sum"],
                    help="h2o score rules: sum, mean, max, tova, snapkv, decay=G, window=W, pool=K, global=S and "
                         "sliding=SCORE (with --compress-sliding), joined by '+'")
    tk.add_argument("--compress-sliding", action="store_true",
                    help="compress sliding-window layers to the budget too (default: they keep their window)")
    tk.add_argument("--sink-tokens", type=int, default=None, help="sink tokens of h2o (default 0; sink: 4)")
    tk.add_argument("--recent-ratio", "--recent-ratios", dest="recent_ratios", type=csv_of(float), default=[0.5],
                    help="shares of the cache for the recent window, one configuration each")
    tk.add_argument("--kv-dtype", "--kv-dtypes", dest="kv_dtypes", type=csv_of(str), default=["model"],
                    help="entry dtypes, every configuration once per dtype: model, int8")
    tk.add_argument("--no-full", action="store_true", help="skip the full-cache reference row")
    tk.add_argument("--text", nargs="+", required=True, help="prose text file(s) the filler is cut from")
    tk.add_argument("--seed", type=int, default=0, help="seed of the generated samples")
    tk.add_argument("--part", default=None,
                    help="START:STOP[:STEP]: run only these sample indices of the --samples grid (split runs, "
                         "tasks-merge; a STEP picks every STEP-th)")
    tk.add_argument("--out", default=None, help="folder for tasks.json / .md / .png (default: runs/tasks-<time>)")
    tk.set_defaults(func=cmd_tasks)

    tm = sub.add_parser("tasks-merge", help="one report (tables, heat map, plots) from task runs of one measurement")
    tm.add_argument("runs", nargs="+", help="folders written by h2o-compile tasks --out (or kvpress_tasks.py)")
    tm.add_argument("--out", default=None,
                    help="folder for the merged tasks.json / .md / .png / samples.jsonl (default: "
                         "runs/tasks-merge-<time>; the older form 'tasks-merge OUT RUNS...' still works)")
    tm.set_defaults(func=cmd_tasks_merge)

