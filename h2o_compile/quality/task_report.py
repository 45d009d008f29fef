"""tasks.json, tasks.md and plots of a task run: accuracy per task x length x configuration x budget, the
pass-key accuracy by depth band, and a depth x length heat map per configuration."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Optional

from ..reporting import command_line, machine_description, markdown_table, plot_lines, write_json
from .task_eval import TaskRun

DEPTH_BANDS = [(0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 1.0001)]


def _band_name(band) -> str:
    return f"{band[0]:.0%}-{min(band[1], 1.0):.0%}"


def _configs(run: TaskRun) -> list[tuple[str, object]]:
    """(label, budget) pairs in first-seen order; the full cache once."""
    seen = []
    for r in run.rows:
        key = (r["label"], None if r["policy"] == "full" else r["budget"])
        if key not in seen:
            seen.append(key)
    return seen


def _match(task, length, label, budget) -> dict:
    """The row fields of one configuration on one task and length (``budget`` None: the full cache, any budget)."""
    match = dict(task=task, length=length, label=label)
    if budget is not None:
        match["budget"] = budget
    return match


def _cell(run: TaskRun, task, length, label, budget, depth_band=None) -> Optional[float]:
    """Accuracy of one configuration (``budget`` None: the full cache, any budget) on one task and length."""
    return run.accuracy(depth_band=depth_band, **_match(task, length, label, budget))


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _rows(run: TaskRun, task, length, label, budget, depth_band=None) -> list[dict]:
    """The rows of one configuration (``budget`` None: any budget) on one task and length (and depth band)."""
    return run.matching(depth_band, **_match(task, length, label, budget))


def _count(run: TaskRun, task, length, label, budget, depth_band=None) -> int:
    return len(_rows(run, task, length, label, budget, depth_band))


def _pct_n(run: TaskRun, task, length, label, budget, depth_band=None) -> str:
    """'80% (50)': the accuracy and the number of samples behind it."""
    x = _cell(run, task, length, label, budget, depth_band)
    return "-" if x is None else f"{_pct(x)} ({_count(run, task, length, label, budget, depth_band)})"


def _state_mib(run: TaskRun, task, length, label, budget) -> str:
    """The state one answer was generated with (MiB per sequence); '-' for rows from runs that predate it."""
    sizes = {r["kv_bytes"] for r in _rows(run, task, length, label, budget) if "kv_bytes" in r}
    return "-" if not sizes else " / ".join(f"{b / 2**20:.2f}" for b in sorted(sizes))


def _state_table(run: TaskRun, task, length, labels, full, budgets) -> list[str]:
    if not any("kv_bytes" in r for r in run.rows):
        return []
    rows = [[label] + [_state_mib(run, task, length, label, None if label in full else b) for b in budgets]
            for label in labels]
    return ["Cache state per sequence (MiB: keys, values, scores, positions of every layer):", "",
            markdown_table(["configuration"] + [f"budget {b}" for b in budgets], rows), ""]


def write_task_report(run: TaskRun, out_dir, *, model_name: str, settings: dict, sources=()) -> dict:
    """Write tasks.json (every sample's output and score), tasks.md and the plots; returns kind -> Path.
    ``sources``: the runs a merged report came from (their folder, command and machine, listed in tasks.md)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "tasks.json", "markdown": out / "tasks.md"}
    header = {"model": model_name, "settings": settings, "command": command_line(),
              "machine": machine_description(), "seconds": run.seconds}
    if sources:
        header["sources"] = [{k: src.get(k) for k in ("folder", "command", "machine", "seconds")} for src in sources]
        header["machine"] = " / ".join(dict.fromkeys(src.get("machine", "?") for src in sources))
    write_json(paths["json"], {**header, "rows": run.rows})
    tasks = list(dict.fromkeys(r["task"] for r in run.rows))
    lengths = sorted({r["length"] for r in run.rows})
    configs = _configs(run)
    labels = list(dict.fromkeys(label for label, _ in configs))
    budgets = sorted({b for _, b in configs if b is not None})
    lines = [f"# Retrieval tasks: {model_name}", "",
             f"`{header['command']}`", "", f"Machine: {header['machine']}. "
             f"{'Time (the runs together)' if sources else 'Wall time'} {run.seconds / 60:.1f} min.", ""]
    if sources:
        lines += [f"Merged from {len(sources)} runs (same prompts and settings):", ""]
        lines += [f"- `{src['folder']}`: `{src.get('command')}`" for src in sources] + [""]
    lines += [f"Settings: {json.dumps(settings, sort_keys=True)}. Greedy answers; a sample scores 1 when the output "
              "contains its answer (vartrack: the share of the chain's variables named). Each cell: accuracy "
              "(samples behind it).", ""]
    for task in tasks:
        for length in lengths:
            if not any(r["task"] == task and r["length"] == length for r in run.rows):
                continue
            lines += [f"## {task}, {length} tokens", ""]
            full = {label for label, budget in configs if budget is None}  # full-cache rows: any budget
            rows = [[label] + [_pct_n(run, task, length, label, None if label in full else b)
                               for b in budgets] for label in labels]
            lines += [markdown_table(["configuration"] + [f"budget {b}" for b in budgets], rows), ""]
            lines += _state_table(run, task, length, labels, full, budgets)
            if task == "passkey":
                lines += [f"By depth of the key (accuracy per band of the filler), {length} tokens:", ""]
                rows = []
                for label, budget in configs:
                    name = label if budget is None else f"{label} @ {budget}"
                    rows.append([name] + [_pct_n(run, task, length, label, budget, band)
                                          for band in DEPTH_BANDS])
                lines += [markdown_table(["configuration"] + [_band_name(b) for b in DEPTH_BANDS], rows), ""]
    paths["markdown"].write_text("\n".join(lines) + "\n")
    for task in tasks:
        for length in lengths:
            series = {}
            for label in labels:
                points = [(b, _cell(run, task, length, label, b)) for b in budgets]
                points = [(b, y) for b, y in points if y is not None]
                if label != "full cache" and points:
                    series[label] = ([b for b, _ in points], [y for _, y in points])
            full = _cell(run, task, length, "full cache", None)
            if series:
                path = out / f"{task}_{length}.png"
                plot_lines(path, series, xlabel="budget (fraction of the sequence)", ylabel="accuracy",
                           title=f"{task}, {length} tokens: {model_name}", logx=True,
                           hlines=None if full is None else {"full cache": full})
                paths[f"plot_{task}_{length}"] = path
    if "passkey" in tasks:
        paths["heatmap"] = _heatmap(run, out / "passkey_depth_heatmap.png", configs, lengths, model_name)
    return paths


def _heatmap(run: TaskRun, path: Path, configs, lengths, model_name: str) -> Path:
    """One panel per configuration: pass-key accuracy by depth band (rows) x length (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(configs))
    rows = -(-len(configs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.1 * rows), squeeze=False)
    for ax, (label, budget) in zip(axes.flat, configs):
        grid = [[_cell(run, "passkey", n, label, budget, band) for n in lengths] for band in DEPTH_BANDS]
        values = [[float("nan") if v is None else v for v in row] for row in grid]
        ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(DEPTH_BANDS)), [_band_name(b) for b in DEPTH_BANDS])
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, _pct(v), ha="center", va="center", fontsize=8)
        title = label if budget is None else f"{label} @ {budget}"
        ax.set_title(textwrap.fill(title, 34), fontsize=8)  # rule specs are long: wrap, never overlap panels
    for ax in list(axes.flat)[len(configs):]:
        ax.axis("off")
    fig.suptitle(f"pass-key accuracy by depth x length: {model_name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
