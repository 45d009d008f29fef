"""Writing results the way people read them: JSON for machines, a markdown table, a PNG plot."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Sequence


def machine_description() -> str:
    """CPU model and core count (and torch version), for the header of every result file."""
    import torch

    model = platform.processor() or "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    cores = torch.get_num_threads()
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{model}, {cores} torch threads{gpu}; torch {torch.__version__}, Python {sys.version.split()[0]}"


def command_line() -> str:
    return " ".join(["h2o-compile" if Path(sys.argv[0]).name == "h2o-compile" else Path(sys.argv[0]).name,
                     *sys.argv[1:]])


def print_report(paths: dict) -> None:
    """Show a command's markdown report and name every file it wrote (``paths``: kind -> Path)."""
    print(paths["markdown"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    def fmt(x):
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")


def plot_lines(path: Path, series: dict, *, xlabel: str, ylabel: str, title: str, logx: bool = False,
               hlines: dict | None = None) -> None:
    """series: label -> (xs, ys); hlines: label -> y (drawn dashed across the plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    for label, y in (hlines or {}).items():
        ax.axhline(y, linestyle="--", color="gray", label=label)
    if logx:  # ticks at the measured xs, written plainly (0.05, not 5 x 10^-2)
        ax.set_xscale("log")
        ticks = sorted({x for xs, _ in series.values() for x in xs})
        if ticks:
            ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def plot_bars(path: Path, groups: Sequence[str], series: dict, *, ylabel: str, title: str,
              rotation: int = 0) -> None:
    """Grouped bars: series maps a label to one value per group (``rotation``: degrees for long group names)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=label)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups, rotation=rotation,
                  ha="right" if rotation else "center")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
