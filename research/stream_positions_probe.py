"""Probe: does H2O lose to StreamingLLM over long streams because of how rolling positions number its keys?

Rolling positions (kernels/rolling.py) number the kept keys by rank, so a heavy hitter from 60,000 tokens ago
sits a few hundred positions before the query; with true positions, Gemma 3 270M's h2o matched sink up to the
model's 32k positions and then broke (docs/results/stream/gemma3_64k). This probe replaces, for the reference
op only (the stream runs eager), the rank numbering by *capped distances*: every key keeps its true distance to
the block's last query up to ``--max-distance`` D, and older keys sit at distance D (their order among
themselves is lost, their distance is one the model was trained on). It was the measurement that led to the
library's ``positions="capped"`` (kernels/rolling.py, every backend), which numbers keys the same way from the
block's true positions; the probe is kept because the results it wrote (docs/results/stream) cite it.

    python research/stream_positions_probe.py --model gemma3-270m \\
        --text ../shared/data/books/war_and_peace.txt --tokens 65536 --budget-slots 1024 --chunk 128 \\
        --max-distance 16384 --out docs/results/stream/gemma3_64k_capped16384

Writes the same report as ``h2o-compile stream`` (stream.json / .md / .png, with the command and machine).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from torch import Tensor

from h2o_compile.kernels import reference
from h2o_compile.kernels.rolling import RopeTables, rotate
from h2o_compile.quality.stream import stream_perplexity
from h2o_compile.quality.stream_report import write_stream_report
from h2o_compile.zoo.data import encode_stream
from h2o_compile.zoo.loading import load_pretrained


def table_frequencies(tables: RopeTables) -> tuple[Tensor, Tensor]:
    """The rotary frequencies [R] and amplitudes [R] (float64) behind tables built at positions 0..S-1.

    Read from position 1 (unambiguous: every frequency is below pi), then refined from position S-1 so that
    positions far past S stay accurate (the error shrinks by S)."""
    cos, sin = tables.cos[0].double(), tables.sin[0].double()          # [S, R]
    amplitude = cos[0]
    rough = torch.atan2(sin[1], cos[1])
    last = cos.shape[0] - 1
    turns = torch.round((rough * last - torch.atan2(sin[last], cos[last])) / (2 * math.pi))
    return (torch.atan2(sin[last], cos[last]) + 2 * math.pi * turns) / last, amplitude


def wide_tables(tables: RopeTables, rows: int) -> RopeTables:
    """The model's rotary tables recomputed in float64 at positions 0..rows-1 ([1, rows, R]), past the S rows
    the graph built, for kernels/rolling.rotate (which rotates in the tables' dtype)."""
    frequency, amplitude = table_frequencies(tables)
    angle = torch.arange(rows, dtype=torch.float64)[:, None] * frequency
    return RopeTables((angle.cos() * amplitude)[None], (angle.sin() * amplitude)[None])


def capped_rotate_block(max_distance: int):
    """A drop-in for kernels/rolling.rotate_block numbering keys by true distance, capped at ``max_distance``."""
    built: dict[bytes, RopeTables] = {}  # one wide table per rotary kind (Gemma 3: local and global bases)

    def rotate_block(q: Tensor, k: Tensor, key_cache: Tensor, pos_cache: Tensor, valid: Tensor,
                     tables: RopeTables) -> tuple[Tensor, Tensor, Tensor]:
        key = tables.cos[0, :2].double().numpy().tobytes() + tables.sin[0, :2].double().numpy().tobytes()
        if key not in built:
            built[key] = wide_tables(tables, max_distance + 1)           # positions 0..D: the last query sits at D
        wide = built[key]
        newest_held = pos_cache.max(dim=-1, keepdim=True).values        # [B, Hkv, 1]; the recent window holds it
        block = newest_held + 1 + (valid.long().cumsum(-1) - 1).clamp(min=0)[:, None, :]   # [B, Hkv, T]
        base = block[..., -1:] - max_distance
        cache_positions = (pos_cache - base).clamp(min=0)
        return (rotate(q, wide, block - base), rotate(k, wide, block - base),
                rotate(key_cache, wide, cache_positions))

    return rotate_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", nargs="+", required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--budget-slots", type=int, required=True)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--max-distance", type=int, required=True, help="D: keys older than D sit at distance D")
    parser.add_argument("--rule", default="sum")
    parser.add_argument("--recent-ratio", type=float, default=0.5)
    parser.add_argument("--window-tokens", type=int, default=2048)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.max_distance < args.chunk:
        raise ValueError(f"--max-distance {args.max_distance}: must be at least --chunk {args.chunk}")
    reference.rotate_block = capped_rotate_block(args.max_distance)
    model, tokenizer = load_pretrained(args.model)
    texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in args.text]
    ids = torch.from_numpy(encode_stream(tokenizer, texts).astype("int64"))[:args.tokens]
    start = time.perf_counter()
    run = stream_perplexity(model, ids, capacity=args.budget_slots, chunk=args.chunk, policy="h2o",
                            positions="rolling", window_tokens=args.window_tokens, rule=args.rule,
                            recent_ratio=args.recent_ratio,
                            desc=f"h2o {args.rule}, distances capped at {args.max_distance}")
    paths = write_stream_report([run], args.out, model_name=args.model, text_names=[Path(p).name for p in args.text],
                                max_positions=getattr(model.config, "max_position_embeddings", None),
                                elapsed_s=time.perf_counter() - start)
    markdown = Path(paths["markdown"])
    markdown.write_text(probe_note(args.max_distance) + markdown.read_text())
    print(f"stream perplexity {run.perplexity:.3f}; wrote {paths}")


def probe_note(max_distance: int) -> str:
    """What the shared stream report cannot say: its "rolling positions" rows ran with this probe's numbering."""
    return (f"> Probe (research/stream_positions_probe.py): the rows labelled \"rolling positions\" ran with every "
            f"key at its true distance to the block's last query, capped at {max_distance:,}, not at its rank.\n\n")


if __name__ == "__main__":
    main()
