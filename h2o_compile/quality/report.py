"""Turn an EvalResult into the three files people look at: JSON, a markdown table and the paper's plot."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from .evaluation import EvalResult
from ..reporting import command_line, machine_description, markdown_table, plot_lines, write_json


def result_rows(result: EvalResult):
    full_ppl = result.perplexity.get("full", {}).get(1.0)
    rows = []
    for policy, by_budget in result.agreement.items():
        for budget, agree in sorted(by_budget.items()):
            ppl = result.perplexity.get(policy, {}).get(budget)
            ratio = (ppl / full_ppl if full_ppl else float("nan")) if ppl is not None else "-"
            kv = result.kv_bytes.get(policy, {}).get(budget)
            kv_mib = f"{kv / 2**20:.2f}" if kv is not None else "-"
            rows.append((policy, budget, "-" if ppl is None else ppl, ratio, agree["rouge_l"], agree["prefix"],
                         kv_mib))
    return rows


def budget_table(result: EvalResult) -> str:
    """Markdown: one row per budget, one column per policy, each cell the perplexity (x the full cache), the
    best policy of a row in bold; with the H2O state per sequence of the row (the same for every policy)."""
    labels = [label for label in result.perplexity if label != "full"]
    budgets = sorted({b for label in labels for b in result.perplexity[label]})
    full = result.perplexity.get("full", {}).get(1.0)
    lines = ["| budget | KV MiB / seq | " + " | ".join(labels) + " |", "|---" * (len(labels) + 2) + "|"]
    for budget in budgets:
        values = {label: result.perplexity[label].get(budget) for label in labels}
        best = min((v for v in values.values() if v is not None), default=None)
        kv = next((result.kv_bytes[label][budget] for label in labels if budget in result.kv_bytes.get(label, {})),
                  None)
        cells = []
        for label in labels:
            value = values[label]
            if value is None:
                cells.append("-")
                continue
            text = f"{value:.2f}" + (f" ({value / full:.3f}x)" if full else "")
            present = sum(v is not None for v in values.values())
            cells.append(f"**{text}**" if value == best and present > 1 else text)
        kv_text = "-" if kv is None else f"{kv / 2**20:.2f}"
        lines.append(f"| {budget:g} | {kv_text} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _sliding_note(result: EvalResult) -> str:
    count = result.reference_bytes.get("sliding_layers", 0)
    if not count:
        return ""
    how = "are compressed to the budget too" if result.settings.get("compress_sliding") else "keep their window"
    return f" The model's {count} sliding-window layers {how}."


def write_eval_report(result: EvalResult, out_dir, *, model_name: str, text_names, elapsed_s: float,
                      sources: Sequence[dict] = ()) -> dict:
    """Writes eval.json, eval.md and a plot under out_dir (eval_perplexity.png, or eval_agreement.png when only
    agreement was measured); returns their paths. ``sources``: the runs a merged result came from (their
    folder and command, listed in eval.md)."""
    out = Path(out_dir)
    s = result.settings
    plot_name = "eval_perplexity.png" if s["num_seqs"] else "eval_agreement.png"
    paths = {"json": out / "eval.json", "markdown": out / "eval.md", "plot": out / plot_name}
    header = {"command": command_line(), "machine": machine_description(), "model": model_name,
              "texts": list(text_names), "elapsed_s": round(elapsed_s, 1)}
    if sources:
        header["sources"] = [{key: run.get(key) for key in ("folder", "command", "machine", "elapsed_s")}
                             for run in sources]
        machines = list(dict.fromkeys(run.get("machine", "?") for run in sources))
        header["machine"] = " / ".join(machines)  # where the numbers were measured, not where they were merged
    write_json(paths["json"], {**header, **asdict(result)})

    rows = result_rows(result)
    pivot = (budget_table(result) + "\n\nEvery configuration:\n\n"
             if sum(label != "full" for label in result.perplexity) > 1 else "")
    merged = ("Merged from " + str(len(sources)) + " runs (same model, texts and settings):\n\n"
              + "".join(f"- `{run['folder']}`: `{run['command']}`\n" for run in sources) + "\n") if sources else ""
    table = markdown_table(["policy", "budget", "perplexity", "x full", "ROUGE-L vs full", "tokens before divergence",
                            "KV MiB / seq"], rows)
    refs = result.reference_bytes
    ref_note = (f"KV MiB / seq: the H2O state (keys, values, fp32 scores, int64 positions) per sequence; a cache of "
                f"every token of every layer holds {refs['full'] / 2**20:.2f} MiB and transformers' own "
                f"DynamicCache {refs['transformers'] / 2**20:.2f} MiB at {refs.get('tokens', s['seq_len'])} tokens."
                f"{_sliding_note(result)}"
                "\n\n") if refs else ""
    paths["markdown"].write_text(
        f"# Quality vs KV budget: {model_name}\n\n"
        f"Command: `{header['command']}`  \nMachine: {header['machine']}  \nTexts: {', '.join(map(str, text_names))}"
        f"  \n{'Wall time: ' if not sources else 'Time (the runs together): '}{elapsed_s:.0f} s\n\n"
        + (f"Streaming perplexity over {s['num_seqs']} held-out windows of {s['seq_len']} tokens: a "
           f"{s['prompt_len']}-token prompt block, then one token per step, so every prediction after the prompt "
           "comes from the compressed cache. " if s["num_seqs"] else "No perplexity (num_seqs 0). ")
        + f"Generation agreement: greedy {s['gen_new_tokens']} tokens after "
        f"{s['gen_prompts']} prompts of {s['gen_prompt_len']} tokens, compared with the full cache. "
        "Budget = fraction of the sequence kept.\n\n"
        f"{merged}{ref_note}{pivot}{table}\n\n"
        f"![{'perplexity' if s['num_seqs'] else 'agreement'} vs budget]({plot_name})\n")

    if s["num_seqs"]:
        series = {policy: (sorted(by), [by[b] for b in sorted(by)]) for policy, by in result.perplexity.items()
                  if policy != "full"}
        hlines = {"full cache": result.perplexity["full"][1.0]} if "full" in result.perplexity else None
        plot_lines(paths["plot"], series, xlabel="KV-cache budget (fraction of sequence)", ylabel="perplexity",
                   title=f"Streaming perplexity vs budget ({model_name})", logx=True, hlines=hlines)
    else:
        series = {policy: (sorted(by), [by[b]["prefix"] for b in sorted(by)]) for policy, by in
                  result.agreement.items() if policy != "full"}
        plot_lines(paths["plot"], series, xlabel="KV-cache budget (fraction of sequence)",
                   ylabel="greedy tokens before divergence from the full cache",
                   title=f"Generation agreement vs budget ({model_name}, {s['gen_prompt_len']}-token prompts)",
                   logx=True)
    return paths
