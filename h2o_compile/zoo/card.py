"""Model card (``README.md``) for the trained tiny model, filled from :func:`train.run_training`'s summary."""

from __future__ import annotations

from pathlib import Path


def _fmt_duration(seconds: float) -> str:
    minutes, sec = divmod(round(seconds), 60)
    return f"{minutes} min {sec} s ({seconds:.0f} s)"


def render_model_card(s: dict) -> str:
    """Markdown text of the card. ``s`` is the summary dict written to ``train_summary.json``."""
    c, t = s["config"], s["train_config"]
    corpus_rows = "\n".join(
        f"| `{Path(e['path']).name}` | `{e['sha256']}` | {e['train_chars']:,} | {e['heldout_chars']:,} |"
        for e in s["corpus"]
    )
    schedule = (
        f"{t['max_steps']} steps"
        if t["max_steps"]
        else f"time-based: cosine over a {t['minutes']:g}-minute wall-clock budget"
    )
    evals = ", ".join(f"{step}: {nll:.3f}" for step, nll in s["evals"]) or "none"
    return f"""# tiny-llama (h2o_compile test/demo model)

A {s["parameters"] / 1e6:.2f}M-parameter Llama-architecture causal LM trained from scratch on CPU, shipped with
`h2o_compile` so that demos, tests and benchmarks have a real trained model (with real attention
patterns: sinks and heavy hitters) without downloading anything. It is a toy: expect fluent-looking
but meaningless text.

```python
from h2o_compile.zoo import load_tiny
model, tokenizer = load_tiny()  # fp32 by default; the file on disk is fp16
```

## How it was made

```
{s["command"]}
```

Corpus (each file is cleaned, then its last {s["heldout_frac"]:.0%} of characters, cut at a line break, is
held out for evaluation and never trained on; sha256 is of the raw file):

| file | sha256 | train chars | held-out chars |
|---|---|---|---|
{corpus_rows}

Cleanup (`h2o_compile/zoo/data.py:clean_text`): CRLF -> LF; Project Gutenberg header/license removed;
wikitext ` @-@ `, ` @.@ `, ` @,@ ` -> `-`, `.`, `,`. Headings (` = Title = `), `<unk>` and the spaces
around punctuation of wikitext are kept.

Tokenizer: byte-level BPE (`tokenizers`), vocab {s["vocab_size"]:,}, trained on the training split only.
`<|endoftext|>` is bos, eos and pad; the tokenizer prepends it to every sequence, and every training
window started with it. Training stream: {s["train_stream_tokens"]:,} tokens; held-out: {s["heldout_stream_tokens"]:,}.

Architecture: `LlamaForCausalLM`, {c["num_hidden_layers"]} layers, hidden {c["hidden_size"]},
{c["num_attention_heads"]} query heads / {c["num_key_value_heads"]} KV heads (GQA), MLP {c["intermediate_size"]},
RoPE theta 10000, context {c["max_position_embeddings"]}, tied embeddings: {c["tie_word_embeddings"]}.
Parameters: {s["parameters"]:,}. Weights: fp16 `model.safetensors`, {s["weights_bytes"]:,} bytes.

Training: fp32 on CPU ({s["threads"]} threads), AdamW (betas 0.9/0.95, weight decay {t["weight_decay"]} on
matrices), peak lr {t["lr"]:g}, {t["warmup_steps"]} warmup steps then cosine to {t["min_lr_ratio"]:g} x peak
({schedule}), grad clip {t["grad_clip"]}, batch {t["batch_size"]} x {t["seq_len"]} tokens (random contiguous windows),
seed {t["seed"]}. Log: `train_log.txt`; all numbers: `train_summary.json`.

| | |
|---|---|
| training time | {_fmt_duration(s["train_seconds"])} |
| steps | {s["steps"]:,} |
| tokens seen | {s["tokens_seen"]:,} ({s["epochs"]:.2f} epochs of the training stream) |
| final train loss (mean of last 50 steps) | {s["final_train_loss"]:.4f} (perplexity {s["final_train_ppl"]:.2f}) |
| train perplexity, final weights ({s["train_eval_tokens"]:,} tokens) | {s["train_eval_ppl"]:.2f} (nll {s["train_eval_nll"]:.4f}) |
| **held-out perplexity** ({s["heldout_eval_tokens"]:,} tokens) | **{s["heldout_ppl"]:.2f}** (nll {s["heldout_nll"]:.4f}) |

Perplexities of the final weights are measured on the shipped fp16 file loaded in fp32, over non-overlapping
{t["seq_len"]}-token windows, each prefixed with `<|endoftext|>`, every token predicted exactly once.
Periodic held-out NLL during training (step: nll, on {t["eval_windows"]} evenly spaced windows): {evals}.

Versions: torch {s["versions"]["torch"]}, transformers {s["versions"]["transformers"]},
tokenizers {s["versions"]["tokenizers"]}. Trained {s["date"]}.

Data licenses: WikiText-2 is CC BY-SA 3.0 (Merity et al., 2016); *War and Peace* (Tolstoy, tr. Maude) is a
Project Gutenberg public-domain text.
"""


def write_model_card(out_dir: str | Path, summary: dict) -> Path:
    """Write ``README.md`` into ``out_dir`` and return its path."""
    path = Path(out_dir) / "README.md"
    path.write_text(render_model_card(summary))
    return path
