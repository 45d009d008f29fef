"""``h2o-compile demo``: Gemma 3 270M (or the shipped tiny model), full cache vs H2O at 20%, side by side.

Fully offline. It prints; it writes demo.md / demo.json / demo.png only into the folder ``out_dir`` names.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import torch

from ..reporting import command_line, machine_description, markdown_table, plot_bars, write_json
from ..runtime import optimize
from ..zoo.loading import load_pretrained

# Our own prompts, in the registers the shipped tiny model was trained on (encyclopedia prose and a novel).
DEMO_PROMPTS = (
    "The river Aldern rises in the hills north of the town of Marwick and flows south for about forty miles "
    "before it joins the sea. In the eighteenth century the river was used to carry timber and grain to the "
    "coast, and several mills were built along its banks. The largest of these, the Upper Mill, was rebuilt "
    "in 1820 after a fire destroyed the original building. During the war the town was occupied by soldiers, "
    "and the mill was used as a store for the army. After the war the population of the town grew quickly, "
    "and a railway was opened in 1865. The river",
    "Prince Andrew went out onto the steps of the house and looked at the dark road where the carriages had "
    "stood. The evening was cold and the sky was clear. He thought of his father, of the old general who had "
    "spoken to him that morning, and of the battle that every one said must come within a few days. He did "
    "not wish to think of Natasha, and yet her face came to him again and again, as it had on the first "
    "evening at the ball. When he returned to the drawing room the count was still talking of the war, and "
    "Pierre",
    "The album was recorded over three weeks in the spring of 1994 at a small studio in the south of the "
    "country. The band had written most of the songs while on tour the previous year, and several of them "
    "had already been performed live. Critics praised the production and the lyrics, and the first single "
    "reached the top ten in the national chart. The second single was less successful. In an interview the "
    "singer said that the band had wanted to make a record that sounded like their concerts. The album",
)


def _run(h2o, tokenizer, prompt, new_tokens):
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    # Greedy whatever the model's generation_config says (Gemma 3's samples), so both caches are comparable.
    h2o.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up: the first call initialises lazily
    start = time.perf_counter()
    out = h2o.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
    elapsed = time.perf_counter() - start
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return text, h2o.kv_cache_bytes(), new_tokens / elapsed, ids.shape[1]


def run_demo(model: str = "gemma3-270m", out_dir=None, new_tokens: int = 64, budget: float = 0.2,
             width: int = 56) -> dict:
    """Print full-cache and H2O continuations of the built-in prompts for ``model`` (what ``--model`` takes:
    zoo/loading.py);
    with ``out_dir``, also write demo.md / demo.json / demo.png there.

    H2O compresses every layer to the budget, sliding-window layers included (``compress_sliding``): the
    prompts are shorter than Gemma 3's 512-token window, so a window cache alone would keep everything."""
    torch.manual_seed(0)
    hf_model, tokenizer = load_pretrained(model)
    contenders = {"full cache": optimize(hf_model, budget=1.0, policy="full", compile=False),
                  f"H2O {budget:.0%}": optimize(hf_model, budget=budget, compile=False,
                                                            compress_sliding=True)}
    rows, records = [], []
    for i, prompt in enumerate(DEMO_PROMPTS, 1):
        results = {name: _run(h2o, tokenizer, prompt, new_tokens) for name, h2o in contenders.items()}
        prompt_len = next(iter(results.values()))[3]
        print(f"\n=== prompt {i} ({prompt_len} tokens) " + "=" * 40)
        print(textwrap.fill(prompt[-240:], width * 2 + 3, initial_indent="... "))
        columns = [textwrap.wrap(text, width) for text, *_ in results.values()]
        names = list(results)
        print(f"\n{names[0]:<{width}} | {names[1]}")
        print("-" * width + "-+-" + "-" * width)
        for a, b in zip(*(col + [""] * (max(map(len, columns)) - len(col)) for col in columns)):
            print(f"{a:<{width}} | {b}")
        for name, (text, kv, tps, _) in results.items():
            rows.append((i, name, prompt_len, f"{kv / 1024:.0f} KiB", round(tps, 1)))
            records.append({"prompt": i, "contender": name, "prompt_tokens": prompt_len, "kv_cache_bytes": kv,
                            "tokens_per_s": tps, "continuation": text})
        print("  ".join(f"{name}: KV {kv / 1024:.0f} KiB, {tps:.1f} tok/s" for name, (_, kv, tps, _) in
                        results.items()))
    if out_dir is not None:
        _write(Path(out_dir), rows, records, new_tokens, budget, model)
    return {"rows": rows, "records": records}


def _write(out: Path, rows, records, new_tokens, budget, model) -> None:
    header = {"command": command_line(), "machine": machine_description(), "model": model,
              "new_tokens": new_tokens, "budget": budget}
    write_json(out / "demo.json", {**header, "results": records})
    table = markdown_table(["prompt", "cache", "prompt tokens", "KV cache", "tokens/s"], rows)
    (out / "demo.md").write_text(f"# h2o-compile demo: {model}\n\nCommand: `{header['command']}`  \nMachine: "
                                 f"{header['machine']}\n\n{table}\n\n![KV bytes](demo.png)\n")
    names = list(dict.fromkeys(r["contender"] for r in records))
    prompts = sorted({r["prompt"] for r in records})
    series = {name: [r["kv_cache_bytes"] / 1024 for r in records if r["contender"] == name] for name in names}
    plot_bars(out / "demo.png", [f"prompt {p}" for p in prompts], series, ylabel="KV cache (KiB)",
              title=f"KV-cache memory: full cache vs H2O {budget:.0%}")
    print(f"\nwrote {out / 'demo.md'}, {out / 'demo.json'}, {out / 'demo.png'}")
