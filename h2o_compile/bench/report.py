"""Writing the decode benchmark (bench.run_bench) as JSON, markdown and a PNG."""

from __future__ import annotations

from pathlib import Path

from ..reporting import command_line, markdown_table, plot_bars, write_json

TARGETS = {  # headline key -> (target, "higher" | "lower", wording)
    "speedup_vs_eager_full": (3.0, "higher", "tokens/s vs transformers eager DynamicCache (full cache)"),
    "speedup_vs_static_compile": (2.0, "higher", "tokens/s vs transformers StaticCache + torch.compile"),
    "step_ratio_h2o_vs_local": (1.15, "lower", "h2o step time / local step time (same budget)"),
    "kv_bytes_ratio_vs_full": (0.21, "lower", "H2O state bytes / full KV cache bytes"),
    "h2o_roofline_ratio": (2.0, "lower", "H2O step time / roofline time"),
}

METHOD = """\
How it was measured (all contenders in one process, the same token ids and positions for each):

- **Decode**: each contender's cache is filled *synthetically* to `context = total - steps` tokens: the same
  random keys/values (one seeded generator per layer) go into transformers' DynamicCache / StaticCache through
  their `update` API and into the H2O state buffers in place, with the positions a real run would keep
  (`h2o`: the recent window plus random older heavy hitters; `local`: the newest C; `full`: all) and random
  scores, and the H2O token counters set to `context`. The decode step's cost does not depend on these values
  (transformers reads every cached key/value; the H2O step is static-shape and branch-free). Then `steps`
  single-token steps, the last at `total` tokens. Warm-up steps (including torch.compile) are not timed. Each
  repeat times one block per contender, the contender order reversed on every other repeat; between blocks
  the cache is rewound to `context` tokens (transformers: `crop`; H2O: scores, positions and counters restored).
  p50/p95 pool all timed steps; tokens/s is the median over blocks of batch x steps / block time.
- **Compilation**: every compiled contender (transformers' StaticCache forward and each H2OModel decode step)
  gets the same torch.compile settings (`compile=` in Settings: `True` = the default mode; `max-autotune` on
  CPU also freezes the weights so that Inductor prepacks them for its GEMM templates, for both alike).
- **Prefill**: a real forward over a random prompt of `context` tokens at batch 1 into a fresh cache,
  eager for every contender (transformers' generate compiles only the decode step too), for the contenders
  listed in the settings (H2O's prefill cost hardly depends on the budget: it attends over C + T keys).
  H2O prefill is the whole prompt as one block (`prefill="full"`; the reference op attends in query chunks, each
  reading only the keys up to it), then compressed to C.
- **Memory**: `cache` = bytes of the cache tensors from their sizes (H2O: keys, values, fp32 scores, int64
  positions; StaticCache: its preallocated `total`-token buffer; DynamicCache: keys and values of the `total`
  tokens it holds after the last step). `transient` = the largest rise of the process RSS above its resident
  size during a timed block (Linux VmHWM reset through /proc/self/clear_refs): temporaries such as
  DynamicCache's concatenation copies. `process peak RSS` = ru_maxrss of the whole run (all models, all
  contenders alive).
- **Roofline**: the step must read every weight once (an untied embedding: only B rows) and the cache its
  attention reads (DynamicCache: the cached tokens; StaticCache: the whole `total`-long buffer, which SDPA
  reads under a mask; H2O: its whole state of C slots). Roofline time = those bytes / the copy bandwidth
  (read + write counted; the median of the measurements through the run); ratio = measured p50 step / roofline.
"""


def _mib(n):
    return None if n is None else n / 2**20


def _verdict(key, value) -> str:
    target, better, _ = TARGETS[key]
    ok = value >= target if better == "higher" else value <= target
    if ok:
        return "met"
    miss = target / value if better == "higher" else value / target
    return f"**missed** (by {miss:.2f}x)"


def headline_lines(head: dict) -> list[str]:
    if not head:
        return ["(no headline: the run had no h2o@0.2 contender)"]
    title = (f"Headline, model `{head['model']}`, batch {head['batch']}, total {head['total']} tokens, "
             f"H2O budget 0.2 ({head['h2o_tokens_per_s']:.1f} tokens/s):")
    lines = [title, ""]
    for key, (target, better, words) in TARGETS.items():
        if key in head:
            sign = ">=" if better == "higher" else "<="
            lines.append(f"- {words}: **{head[key]:.2f}x** (target {sign} {target}x): {_verdict(key, head[key])}")
    if "step_ratio_h2o_vs_static_same_slots" in head:
        lines.append(f"- h2o step time / StaticCache + compile over the same number of slots without eviction "
                     f"(`hf-static-compile@0.2`, a cost floor, not a method): "
                     f"{head['step_ratio_h2o_vs_static_same_slots']:.2f}x (no target; the H2O bookkeeping overhead)")
    return lines


def decode_rows(rows: list[dict]) -> list[list]:
    base = {(r["model"], r["batch"], r["total"]): r for r in rows if r["contender"] == "hf-dynamic"}
    out = []
    for r in rows:
        ref = base.get((r["model"], r["batch"], r["total"]))
        speedup = r["tokens_per_s"] / ref["tokens_per_s"] if ref else ""
        transient = r.get("transient_peak_mib")
        out.append([r["model"], r["batch"], r["total"], r["contender"], r["capacity"], _mib(r["cache_bytes"]),
                    r["tokens_per_s"], r["step_ms_p50"], r["step_ms_p95"], speedup, r["roofline_ms"],
                    r["roofline_ratio"], "" if transient is None else transient, r["warmup_s"],
                    r.get("foreign_cores", "")])
    return out


DECODE_HEADERS = ["model", "batch", "total", "contender", "C (slots)", "cache MiB", "tokens/s", "p50 ms", "p95 ms",
                  "x hf-dynamic", "roofline ms", "p50/roofline", "transient MiB", "warm-up s", "other procs (cores)"]


def markdown(result: dict, command: str) -> str:
    bw = result["bandwidth"]
    s = result["settings"]
    memory = (f"Memory bandwidth: copy {bw['copy_gb_s']:.1f} GB/s (read + write counted; each measurement is the "
              f"best of {bw['repeats']} copies of {bw['bytes'] / 2**20:.0f} MiB; median of {bw['samples']} "
              f"measurements taken at the start, before every decode configuration and at the end, which ranged "
              f"{bw['copy_gb_s_min']:.1f} to {bw['copy_gb_s_max']:.1f} GB/s), read-only (sum) "
              f"{bw['read_gb_s']:.1f} GB/s. "
              f"Run took {result['elapsed_s']:.0f} s (of which {result.get('waited_for_quiet_s', 0):.0f} s waiting "
              f"for other processes to leave the CPU); process peak RSS {result['peak_rss_mib']:.0f} MiB.")
    run = (f"Settings: models {s['models']}, batches {s['batches']}, totals {s['totals']}, {s['steps']} decode "
           f"steps per block, {s['warmup']} warm-up steps, {s['repeats']} repeats, compile={s['compile']}.")
    lines = ["# Decode on CPU: H2O vs transformers' caches", "",
             f"Command: `{command}`", "", f"Machine: {result['machine']}", "", memory, "", run, ""]
    lines += headline_lines(result["headline"]) + [""]
    if result["skipped"]:
        lines += ["Skipped: " + "; ".join(result["skipped"]), ""]
    lines += ["## Decode", "", markdown_table(DECODE_HEADERS, decode_rows(result["decode"])), ""]
    compiles = {r["compiles_during_timing"] for r in result["decode"]}
    lines += [f"Graphs compiled during timed blocks: {sorted(compiles)} (0 = no step was a recompile).", ""]
    disturbed = sorted({(r["model"], r["batch"], r["total"], round(r.get("foreign_cores", 0), 2))
                        for r in result["decode"] if r.get("foreign_cores", 0) > 0.1})
    lines += ["`other procs` = CPU cores other processes kept busy, on average, while that configuration's blocks "
              "were timed (/proc/stat minus this process). " + (
                  "**Disturbed** (> 0.1 core; treat their numbers with care): " +
                  ", ".join(f"{m} B={b} N={t} ({c} cores)" for m, b, t, c in disturbed) if disturbed
                  else "No configuration was disturbed (all <= 0.1 core)."), ""]
    if result["prefill"]:
        rows = [[r["model"], r["total"], r["prompt_tokens"], r["contender"], r["prefill_s"],
                 r["prefill_tokens_per_s"], r.get("foreign_cores", "")] for r in result["prefill"]]
        lines += ["## Prefill (batch 1, real prompt)", "",
                  markdown_table(["model", "total", "prompt tokens", "contender", "prefill s", "tokens/s",
                                  "other procs (cores)"], rows), ""]
    lines += ["## Method", "", METHOD]
    for name, table in result.get("profiles", {}).items():
        lines += [f"## Profile: {name} (one block of decode steps, self CPU time)", "", "```", table.rstrip(),
                  "```", ""]
    return "\n".join(lines) + "\n"


def plot(path: Path, result: dict) -> None:
    """tokens/s vs total length, one line per contender; a row of panels per model, a column per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["decode"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    if not rows:
        return
    fig, axes = plt.subplots(len(models), len(batches), figsize=(4.8 * len(batches), 3.6 * len(models) + 0.8),
                             dpi=110, squeeze=False)
    names = list(dict.fromkeys(r["contender"] for r in rows))
    for i, model in enumerate(models):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            for k, name in enumerate(names):
                pts = sorted((r["total"], r["tokens_per_s"]) for r in rows
                             if (r["model"], r["batch"], r["contender"]) == (model, batch, name))
                if not pts:
                    continue
                style = ":" if "@" in name and name.startswith("hf") else ("--" if name.startswith("hf") else "-")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=f"C{k}", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("total length (prompt + generated)")
            ax.set_ylabel("decode tokens/s")
            ax.set_title(f"{model}, batch {batch}")
            ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8)
    fig.suptitle("CPU decode throughput (higher is better; dashed: transformers, dotted: cost floor)")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _write(result: dict, out: str, command: str | None, to_markdown, to_png) -> dict:
    """``out``.json / .md / .png (``out`` without extension); returns the paths."""
    command = command or command_line()
    base = Path(out)
    paths = {"json": base.with_suffix(".json"), "markdown": base.with_suffix(".md"), "png": base.with_suffix(".png")}
    write_json(paths["json"], dict(command=command, **result))
    paths["markdown"].write_text(to_markdown(result, command))
    to_png(paths["png"], result)
    return paths


def write_bench_report(result: dict, out: str, command: str | None = None) -> dict:
    """The CPU run (bench.run_bench) as ``out``.json / .md / .png; returns the paths."""
    return _write(result, out, command, markdown, plot)


def cuda_markdown(result: dict, command: str) -> str:
    """The GPU run (bench.cuda.run_cuda_bench): CUDA graphs on/off, and the largest batch under a memory cap."""
    s = result["settings"]
    bw = result["bandwidth"]
    lines = ["# Decode on a GPU: CUDA graphs and the largest batch under a memory cap", "",
             f"Command: `{command}`", "", f"Machine: {result['machine']}", "",
             f"Model `{s['model']}` in {s['dtype']} on {s['device']}; device copy bandwidth {bw['copy_gb_s']:.0f} "
             f"GB/s; run took {result['elapsed_s']:.0f} s.", ""]
    if result["graphs"]:
        base = {r["contender"]: r for r in result["graphs"]}
        eager = base.get("hf-dynamic")
        rows = [[r["contender"], r["label"], r["capacity"], _mib(r["cache_bytes"]), r["tokens_per_s"],
                 r["step_ms_p50"], r["step_ms_p95"], r["tokens_per_s"] / eager["tokens_per_s"] if eager else "",
                 r["roofline_ratio"], r["warmup_s"]] for r in result["graphs"]]
        lines += [f"## CUDA graphs on and off (batch {s['batch']}, total {s['total']})", "",
                  markdown_table(["contender", "what", "C (slots)", "cache MiB", "tokens/s", "p50 ms", "p95 ms",
                                  "x hf-dynamic", "p50/roofline", "warm-up s"], rows), ""]
    if result["memory_cap"]:
        rows = [[r["contender"], r["timed_as"], r["cap_bytes"] / 2**30, r["predicted"], r["batch"],
                 "" if r["need_bytes"] is None else r["need_bytes"] / 2**30, r.get("tokens_per_s", ""),
                 r.get("step_ms_p50", ""), len(r["tries"])] for r in result["memory_cap"]]
        lines += [f"## Largest batch under {s['memory_cap_gib']:g} GiB (total {s['total']} tokens)", "",
                  markdown_table(["contender", "timed as", "cap GiB", "predicted batch", "batch", "peak GiB",
                                  "tokens/s", "p50 ms", "verified runs"], rows), "",
                  "Peak = weights + the filled cache + the most memory the contender allocated over the warm-up "
                  "steps (torch.cuda.max_memory_allocated). The batch is predicted from eager probes at batches "
                  f"{s['probe_batches']} and verified compiled with CUDA graphs.", ""]
    return "\n".join(lines) + "\n"


def cuda_plot(path: Path, result: dict) -> None:
    """tokens/s bars: graphs on and off, then each contender at its largest batch under the cap."""
    bars = [(r["contender"], r["tokens_per_s"]) for r in result["graphs"]]
    bars += [(f"{r['contender']} @ B={r['batch']} (cap)", r.get("tokens_per_s", 0.0)) for r in result["memory_cap"]]
    if bars:
        plot_bars(path, [name for name, _ in bars], {"decode tokens/s": [v for _, v in bars]},
                  ylabel="tokens/s", title=f"GPU decode, {result['settings']['model']} (higher is better)",
                  rotation=30)


def write_cuda_report(result: dict, out: str, command: str | None = None) -> dict:
    """The GPU run (bench.cuda.run_cuda_bench) as ``out``.json / .md / .png; returns the paths."""
    return _write(result, out, command, cuda_markdown, cuda_plot)
