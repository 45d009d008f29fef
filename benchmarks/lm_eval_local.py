"""lm-evaluation-harness through the registered ``h2o`` model on a local task: rolling loglikelihood (word
perplexity, bits per byte) over paragraphs of a text file, the original model through lm-eval's HFLM against
H2O at several budgets, so the harness's figures can be compared with this project's own ``eval``.

    python benchmarks/lm_eval_local.py --text ../shared/data/books/war_and_peace.txt --out docs/results/lm_eval_tiny
    python benchmarks/lm_eval_local.py --model gemma3-270m --budgets 1.0,0.2,0.1 --docs 20 --out DIR

A paragraph is a document; lm-eval scores it whole (rolling windows of the model's length), and H2O scores each
position from the state it keeps at that point (one decode step per token after the first), as
``H2OModel.forward`` documents.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from h2o_compile.cli.arguments import csv_of, parse_budget  # noqa: E402
from h2o_compile.reporting import command_line, machine_description, markdown_table, write_json  # noqa: E402
from h2o_compile.zoo.loading import TINY_LLAMA_DIR, load_pretrained  # noqa: E402

TASK = """task: h2o_local_rolling
dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: "{{text}}"
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}, {metric: bits_per_byte}]
"""


def paragraphs(path: str, count: int, min_words: int) -> list[str]:
    """The first ``count`` paragraphs of at least ``min_words`` words, skipping the file's first tenth (front
    matter)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    blocks = [" ".join(b.split()) for b in text[len(text) // 10:].split("\n\n")]
    return [b for b in blocks if len(b.split()) >= min_words][:count]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="a shipped model (tiny, gemma3-270m), a Hub id or a folder")
    p.add_argument("--text", default=str(ROOT.parent / "shared" / "data" / "books" / "war_and_peace.txt"))
    p.add_argument("--docs", type=int, default=24, help="paragraphs scored")
    p.add_argument("--min-words", type=int, default=120)
    p.add_argument("--budget", "--budgets", dest="budgets", type=csv_of(parse_budget), default=[1.0, 0.5, 0.2])
    p.add_argument("--config", default="recommended", help="the H2O rule string of every budget")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from h2o_compile.integrations import lm_eval_model  # noqa: F401  (registers "h2o")

    docs = paragraphs(args.text, args.docs, args.min_words)
    model, tokenizer = load_pretrained(args.model)
    pretrained = str(TINY_LLAMA_DIR) if args.model == "tiny" else args.model
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "data.jsonl"
        data.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
        (Path(folder) / "task.yaml").write_text(TASK.replace("DATA", str(data)))
        tasks = TaskManager(include_path=folder)
        runs = [("original (HFLM)", HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4), None)]
        runs += [(f"h2o {args.config} @ {b:g}", "h2o", f"pretrained={pretrained},budget={b},config={args.config},"
                  "dtype=float32") for b in args.budgets]
        for name, lm, model_args in runs:
            start = time.perf_counter()
            out = lm_eval.simple_evaluate(model=lm, model_args=model_args, tasks=["h2o_local_rolling"],
                                          task_manager=tasks, batch_size=4)
            metrics = out["results"]["h2o_local_rolling"]
            raw[name] = {k: v for k, v in metrics.items() if isinstance(v, float)}
            rows.append([name, f"{metrics['word_perplexity,none']:.3f}", f"{metrics['bits_per_byte,none']:.4f}",
                         f"{time.perf_counter() - start:.0f}"])
            print(rows[-1], flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {"command": command_line(), "machine": machine_description(), "model": args.model,
              "text": Path(args.text).name, "docs": len(docs), "config": args.config}
    write_json(out_dir / "lm_eval.json", {**header, "results": raw})
    table = markdown_table(["model", "word perplexity", "bits per byte", "seconds"], rows)
    (out_dir / "lm_eval.md").write_text(
        f"# lm-evaluation-harness, local rolling-loglikelihood task\n\n`{header['command']}`\n\n"
        f"Machine: {header['machine']}. Model `{args.model}`, {len(docs)} paragraphs of {header['text']} "
        f"(at least {args.min_words} words each), lm-eval {lm_eval.__version__}.\n\n{table}\n")
    print(f"wrote {out_dir}/lm_eval.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
