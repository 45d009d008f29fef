"""Stream runs -> stream.json, stream.md and stream.png (perplexity per window and RSS along the stream)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from ..reporting import command_line, machine_description, markdown_table, write_json
from .stream import StreamRun, run_dict


def age_summary(run: StreamRun) -> tuple[Optional[tuple[int, int]], Optional[float]]:
    """From the run's age histogram: the bin [lo, hi) holding the median age of the kept keys older than the
    recent window (the keys the policy chose to keep, not the window), and the share of all kept keys older than
    4 C. (None, None) without a histogram; 4 C and R are bin edges (age_bin_edges), so the share is exact."""
    total = sum(run.age_counts)
    if not total:
        return None, None
    bins = list(zip(run.age_edges, run.age_edges[1:], run.age_counts))
    chosen = [(lo, hi, count) for lo, hi, count in bins if lo >= run.recent_slots]
    running, median, half = 0, None, sum(count for _, _, count in chosen) / 2
    for lo, hi, count in chosen:
        running += count
        if count and running >= half:
            median = (lo, hi)
            break
    old = sum(count for lo, _, count in bins if lo >= 4 * run.capacity)
    return median, old / total


def write_stream_report(runs: Sequence[StreamRun], out_dir, *, model_name: str, text_names: Sequence[str],
                        max_positions, elapsed_s: float, command: Optional[str] = None,
                        machine: Optional[str] = None) -> dict:
    """Writes stream.json / .md, stream.png and stream_ages.png under ``out_dir``; returns their paths.
    ``command``, ``machine``: what to record (default: this process's; a rewritten report keeps the run's)."""
    out = Path(out_dir)
    paths = {"json": out / "stream.json", "markdown": out / "stream.md", "plot": out / "stream.png",
             "ages": out / "stream_ages.png"}
    header = {"command": command or command_line(), "machine": machine or machine_description(), "model": model_name,
              "texts": list(text_names), "max_position_embeddings": max_positions, "elapsed_s": round(elapsed_s, 1)}
    write_json(paths["json"], {**header, "runs": [run_dict(r) for r in runs]})

    rows = []
    for run in runs:
        s = run.summary()
        growth = s["rss_growth_from_10pct"]
        first_full = "-" if s["first_full_window_ppl"] is None else f"{s['first_full_window_ppl']:.3f}"
        ratio = "-" if s["last_vs_first_full"] is None else f"{s['last_vs_first_full']:.3f}"
        rows.append((run.label, run.sink_tokens, f"{run.perplexity:.3f}", first_full,
                     f"{s['last_window_ppl']:.3f}", ratio,
                     "-" if growth is None else f"{growth:+.2%}", f"{s['tokens_per_s_first']:.0f}",
                     f"{s['tokens_per_s_last']:.0f}", f"{run.kv_bytes / 2**20:.2f}", f"{run.seconds:.0f}"))
    table = markdown_table(["run", "sinks", "stream ppl", "first full window ppl", "last window ppl", "last / first",
                            "RSS growth (10% -> end)", "tok/s first", "tok/s last", "KV MiB", "wall s"], rows)
    age_rows = []
    for run in runs:
        median, old = age_summary(run)
        age_rows.append((run.label, run.recent_slots or "-",
                         "-" if median is None else f"{median[0]:,}-{median[1]:,}",
                         "-" if old is None else f"{old:.1%}"))
    first = runs[0]
    age_table = markdown_table(["run", "recent window R", "median age of the kept keys older than R (its bin)",
                                f"kept keys older than 4 C ({4 * first.capacity:,} tokens)"], age_rows)
    positions_note = (f" The model was trained on {max_positions} positions: the stream is "
                      f"{first.tokens / max_positions:.0f}x that.") if max_positions else ""
    paths["markdown"].write_text(
        f"# Streaming at constant memory: {model_name}\n\n"
        f"Command: `{header['command']}`  \nMachine: {header['machine']}  \nTexts: {', '.join(text_names)} "
        f"(concatenated, one stream)  \nWall time: {elapsed_s:.0f} s\n\n"
        f"{first.tokens:,} tokens fed in chunks of {first.chunk} through one cache of {first.capacity} slots per "
        f"layer and KV head (memory: C + one chunk), each chunk's logits scoring the next tokens.{positions_note} "
        f"Windows of {first.windows[0].end - first.windows[0].start:,} scored tokens; the first full window is "
        "the first one that starts after eviction began (position > C). RSS: the process's resident memory at the "
        "end of each window. Rolling positions number the cached keys 0..n-1 by age at every step; capped "
        "distances rotate each at its true distance to the newest token, up to the cap; true positions "
        "rotate them at their place in the stream.\n\n"
        f"{_sliding_note(runs)}{table}\n\n![perplexity and memory along the stream]({paths['plot'].name})\n\n"
        "Age of the keys the full-attention layers hold at the stream's end (age = the newest position - the "
        "key's position; every layer, KV head and slot together; sliding-window layers are left out, their window "
        "decides what they hold). The median is taken over the keys older than the recent window R (h2o: the heavy "
        "hitters its rule kept; policies without a recent window: every kept key):\n\n"
        f"{age_table}\n\n![ages of the kept keys]({paths['ages'].name})\n")
    _plot(paths["plot"], runs, model_name)
    _plot_ages(paths["ages"], runs, model_name)
    return paths


def _plot(path: Path, runs: Sequence[StreamRun], model_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ppl_ax, rss_ax) = plt.subplots(2, 1, figsize=(7.0, 6.4), dpi=120, sharex=True,
                                         gridspec_kw={"height_ratios": [2, 1]})
    for run in runs:
        xs = [w.end for w in run.windows]
        ppl_ax.plot(xs, [w.perplexity for w in run.windows], label=run.label, linewidth=1.2)
        rss_ax.plot(xs, [w.rss_mib for w in run.windows], label=run.label, linewidth=1.2)
    ppl_ax.set_yscale("log")
    ppl_ax.set_ylabel("perplexity per window")
    ppl_ax.set_title(f"Streaming with {runs[0].capacity} cache slots ({model_name})")
    ppl_ax.grid(alpha=0.3, which="both")
    ppl_ax.legend()
    rss_ax.set_xlabel("position in the stream (tokens)")
    rss_ax.set_ylabel("RSS (MiB)")
    rss_ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _plot_ages(path: Path, runs: Sequence[StreamRun], model_name: str) -> None:
    """One line per run: the share of kept keys per age bin (log-2 bins, so a line is a histogram's outline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.0), dpi=120)
    for run in runs:
        total = sum(run.age_counts)
        if not total:
            continue
        ax.step([max(edge, 0.5) for edge in run.age_edges], [c / total for c in run.age_counts] + [0.0],
                where="post", label=run.label, linewidth=1.2)
    ax.axvline(runs[0].capacity, color="grey", linestyle=":", linewidth=1, label=f"C = {runs[0].capacity}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("age of a kept key at the stream's end (tokens, log 2 bins)")
    ax.set_ylabel("share of kept keys")
    ax.set_title(f"What the cache holds after {runs[0].tokens:,} tokens ({model_name})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _sliding_note(runs) -> str:
    if not any(run.compress_sliding for run in runs):
        return ""
    return ("Runs with \"sliding layers compressed\" hold min(C, W) slots on a sliding-window layer of window W, "
            "under the policy; a rule with global=S gives each full-attention layer S x C slots and the "
            "sliding-window layers the rest of the same total (H2OConfig.global_share; KV MiB is the state "
            "held).\n\n")
