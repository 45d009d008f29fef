"""One report from several task runs (``h2o-compile tasks-merge OUT RUN...``): a run too slow for one process,
split by sample range (``tasks --part``), configuration or budget, and runs of other programs on the same task
file (benchmarks/kvpress_tasks.py), merged into one table.

Runs merge only if they measured the same prompts: the same model name, sample grid (``samples``), ``seed`` and
filler text, and the same sliding-layer and sink settings; their task files (samples.jsonl) must agree on
every prompt they share. A sample measured by two runs under one configuration must have the same score (greedy
decoding is deterministic); otherwise the merge refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .merge import check_same_measurement
from .task_eval import TaskRun
from .task_report import write_task_report
from .tasks import read_samples, write_samples

# Settings that define which prompts were run and how the sliding layers were kept; tasks, lengths, budgets,
# policies, rules, recent ratios and the part of the grid may differ between runs.
SAME_SETTINGS = ("samples", "seed", "filler", "compress_sliding", "sink_tokens")


def load_task_run(folder) -> dict:
    """tasks.json of a run folder (and its samples.jsonl when there is one)."""
    path = Path(folder) / "tasks.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no tasks.json (give folders written by h2o-compile tasks --out)")
    run = json.loads(path.read_text())
    run["folder"] = str(folder)
    samples = Path(folder) / "samples.jsonl"
    run["samples"] = read_samples(samples) if samples.is_file() else []
    return run


def _key(row) -> tuple:
    return (row["task"], row["length"], row["index"], row["label"], None if row["policy"] == "full" else row["budget"])


def merge_task_rows(runs: Sequence[dict]) -> tuple[TaskRun, dict, list]:
    """(TaskRun of every run's rows, merged settings, merged samples). ValueError when the runs measured
    different prompts or settings, or disagree on a sample's score."""
    if not runs:
        raise ValueError("nothing to merge: give at least one run folder")
    first = runs[0]
    check_same_measurement(runs, ("model",), SAME_SETTINGS)
    samples, sample_owner = {}, {}
    for run in runs:
        for s in run["samples"]:
            where = (s.task, s.length, s.index)
            if where in samples and samples[where].prompt_ids != s.prompt_ids:
                raise ValueError(f"{s.task} sample {s.index} at {s.length} tokens: {sample_owner[where]} and "
                                 f"{run['folder']} hold different prompts")
            samples.setdefault(where, s)
            sample_owner.setdefault(where, run["folder"])
    merged, owner = {}, {}
    for run in runs:
        for row in run["rows"]:
            key = _key(row)
            if key in merged and merged[key]["score"] != row["score"]:
                raise ValueError(f"{row['label']} on {row['task']} sample {row['index']} ({row['length']} tokens): "
                                 f"score {merged[key]['score']} in {owner[key]} but {row['score']} in {run['folder']}")
            merged.setdefault(key, row)
            owner.setdefault(key, run["folder"])
    rows = list(merged.values())
    settings = dict(first["settings"])
    for key in ("tasks", "lengths", "budgets", "policies", "rules", "recent_ratios"):
        values = []
        for run in runs:
            values += [v for v in run["settings"].get(key) or [] if v not in values]
        settings[key] = values
    settings["part"] = "merged"
    settings["samples_measured"] = len({(r["task"], r["length"], r["index"]) for r in rows})
    result = TaskRun(rows=rows, seconds=sum(run.get("seconds", 0.0) for run in runs))
    return result, settings, sorted(samples.values(), key=lambda s: (s.task, s.length, s.index))


def merge_task_runs(folders: Sequence, out) -> dict:
    """Merge the runs in ``folders`` into ``out`` (tasks.json / .md / plots / samples.jsonl); kind -> Path."""
    out_path = Path(out).resolve()
    if any(Path(folder).resolve() == out_path for folder in folders):
        raise ValueError(f"OUT {out} is one of the runs to merge: it would overwrite that run's report")
    runs = [load_task_run(folder) for folder in folders]
    result, settings, samples = merge_task_rows(runs)
    paths = write_task_report(result, out, model_name=runs[0]["model"], settings=settings, sources=runs)
    if samples:
        paths["samples"] = write_samples(Path(out) / "samples.jsonl", samples, seed=settings.get("seed"))
    return paths
