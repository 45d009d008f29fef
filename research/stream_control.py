"""Same-text control for a stream result: does a long history cost perplexity?

A stream's first and last windows hold different text, so their perplexities differ for reasons that have
nothing to do with the cache. This reads a ``h2o-compile stream`` result (stream.json) and runs every
configuration again on the stream's last 2W tokens only (W = the window size), from an empty cache: the first W
tokens fill the cache, the second W are the stream's last window, now read after a history of W tokens instead
of the whole stream. Writes control.json and control.md next to stream.json.

    python research/stream_control.py docs/results/stream/tiny_1m --model tiny \\
        --text ../shared/data/books/war_and_peace.txt ../shared/data/wikitext-2/test.txt ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from h2o_compile.zoo.loading import load_pretrained
from h2o_compile.quality.stream import stream_perplexity
from h2o_compile.reporting import command_line, machine_description, markdown_table, write_json
from h2o_compile.zoo.data import encode_stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the folder of a stream result (stream.json)")
    parser.add_argument("--model", required=True, help="the model the stream ran (as its --model)")
    parser.add_argument("--text", nargs="+", required=True, help="the stream's --text files, in order")
    args = parser.parse_args()
    folder = Path(args.folder)
    result = json.loads((folder / "stream.json").read_text())
    model, tokenizer = load_pretrained(args.model)
    texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in args.text]
    ids = torch.from_numpy(encode_stream(tokenizer, texts).astype("int64"))
    rows, records = [], []
    for run in result["runs"]:
        last = run["windows"][-1]
        width = last["end"] - last["start"]
        begin = last["start"] - 1 - width           # W tokens of history, then the last window's text
        fresh = stream_perplexity(model, ids[begin:last["end"]], capacity=run["capacity"], chunk=run["chunk"],
                                  policy=run["policy"], positions=run["positions"], sink_tokens=run["sink_tokens"],
                                  window_tokens=width, rule=run.get("rule", "sum"),
                                  recent_ratio=run.get("recent_ratio", 0.5), progress=False,
                                  max_distance=run.get("max_distance") or None,
                                  compress_sliding=run.get("compress_sliding", False))
        again = fresh.windows[-1]
        assert (again.start + begin, again.end + begin) == (last["start"], last["end"])
        ratio = last["perplexity"] / again.perplexity
        label = fresh.label
        records.append({"label": label, "policy": run["policy"], "rule": fresh.rule, "positions": run["positions"],
                        "window": [last["start"], last["end"]],
                        "after_stream_ppl": last["perplexity"], "fresh_ppl": again.perplexity,
                        "after_stream_vs_fresh": ratio})
        rows.append((label, f"{last['start']:,}-{last['end']:,}",
                     f"{last['perplexity']:.3f}", f"{again.perplexity:.3f}", f"{ratio:.3f}"))
    write_json(folder / "control.json", {"command": command_line(), "machine": machine_description(),
                                         "stream": str(folder / "stream.json"), "runs": records})
    table = markdown_table(["run", "last window (positions)", "ppl after the whole stream",
                            "ppl after W tokens (fresh cache)", "ratio"], rows)
    (folder / "control.md").write_text(
        f"# Same-text control: {result['model']}\n\nCommand: `{command_line()}`  \nMachine: {machine_description()}\n\n"
        "The stream's last window read twice with the same configuration: after the whole stream, and from an "
        "empty cache after only the W tokens before it (W = the window size). A ratio near 1 means the long "
        f"history cost nothing.\n\n{table}\n")
    print((folder / "control.md").read_text())


if __name__ == "__main__":
    main()
