"""``h2o-compile calibrate``: the split of the budget's slots between layers (and KV heads) from a model's attention
on a text (runtime/allocation.py), printed as a rule string and written as h2o_config.json, with a plot of the split
next to the attention statistics that chose it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..graph.support import check_supported
from ..runtime.allocation import attention_curves, split_of
from ..runtime.cache_plan import layer_params
from ..zoo.loading import load_pretrained
from .arguments import MODEL_HELP, require


def add_calibrate_parser(sub, add_h2o_args, config_of) -> None:
    cal = sub.add_parser("calibrate", help="split the budget's slots between layers by the model's attention")
    cal.add_argument("--model", required=True, help=MODEL_HELP)
    cal.add_argument("--text", required=True, help="a plain-text file to calibrate on (text of the kind served)")
    cal.add_argument("--tokens", type=int, default=1024, help="tokens per calibration row: the sequence length served")
    cal.add_argument("--rows", type=int, default=2, help="rows of --tokens tokens, read one after the other")
    cal.add_argument("--head-groups", type=int, default=1,
                     help="1: split between layers; more: each layer's KV heads too, in at most that many groups")
    cal.add_argument("--out", default=None, help="folder for h2o_config.json, split.json and split.png")
    add_h2o_args(cal)
    cal.set_defaults(func=lambda args: cmd_calibrate(args, config_of(args)))


def cmd_calibrate(args, config) -> int:
    for name, least in (("tokens", 2), ("rows", 1), ("head_groups", 1)):
        if getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: allowed: an int >= {least}")
    if args.out:
        require("calibrate --out", "matplotlib")
    path = Path(args.text)
    if not path.is_file():
        raise FileNotFoundError(f"--text {args.text!r}: no such file")
    model, tokenizer = load_pretrained(args.model)
    ids = calibration_rows(tokenizer, path.read_text(encoding="utf-8", errors="replace"), args.tokens, args.rows)
    windows = check_supported(model).windows
    curves = attention_curves(model, ids)                                      # [Hkv, T + 1] per layer
    uniform = config.replace(allocation="uniform")
    calibrated = uniform.replace(allocation=split_of(uniform, windows, curves, args.tokens, args.head_groups))
    c = uniform.capacity(args.tokens)
    slots = [[layer_params(uniform, args.tokens, w, share=share)[0] for share in head_shares(entry, len(curve))]
             for entry, w, curve in zip(calibrated.allocation, windows, curves)]   # per layer and KV head
    even = [layer_params(uniform, args.tokens, w)[0] * len(curve) for w, curve in zip(windows, curves)]
    print(f"{'layer':>5} {'window':>6}  slots per KV head    mass kept by C={c} slots (uniform)")
    for layer, (w, n, curve) in enumerate(zip(windows, slots, curves)):
        print(f"{layer:>5} {w or 'full':>6}  {' '.join(map(str, n)):<20} "
              f"{float(curve.mean(0)[min(c, curve.shape[1] - 1)]):.3f}")
    print(f"slots in all: {sum(map(sum, slots))} (the uniform split: {sum(even)})")
    print(f"rule string: {calibrated.to_string()}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "h2o_config.json").write_text(json.dumps(calibrated.to_dict(), indent=2))
        kept = [[[round(float(v), 4) for v in head] for head in curve] for curve in curves]
        (out / "split.json").write_text(json.dumps({"model": args.model, "text": args.text, "tokens": args.tokens,
                                                    "rows": args.rows, "capacity": c, "windows": list(windows),
                                                    "head_groups": args.head_groups, "slots": slots,
                                                    "allocation": calibrated.to_dict()["allocation"],
                                                    "kept_mass": kept}))
        plot_split(out / "split.png", windows, slots, c, curves, title=f"{args.model}, {args.tokens} tokens")
        print(f"wrote {out}/h2o_config.json, split.json, split.png")
    return 0


def head_shares(entry, kv_heads: int) -> tuple[float, ...]:
    """A layer's entry of a calibrated allocation as one share per KV head."""
    return entry if isinstance(entry, tuple) else (entry,) * kv_heads


def calibration_rows(tokenizer, text: str, tokens: int, rows: int) -> torch.Tensor:
    """[rows, tokens]: consecutive stretches of ``text``, each starting as the tokenizer starts a text (its BOS,
    when it adds one), as the model sees a request. ValueError when the text is too short."""
    start = tokenizer("a").input_ids[:1]
    start = start if start and start[0] == tokenizer.bos_token_id else []
    per_row = tokens - len(start)
    ids = tokenizer(text[: per_row * rows * 16], add_special_tokens=False).input_ids
    if len(ids) < per_row * rows:
        ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < per_row * rows:
        raise ValueError(f"--text holds {len(ids)} tokens; --tokens {tokens} x --rows {rows} needs "
                         f"{per_row * rows} besides the rows' first token")
    return torch.tensor([start + ids[i * per_row:(i + 1) * per_row] for i in range(rows)])


def plot_split(path: Path, windows, slots, capacity: int, curves, title: str) -> None:
    """Slots per layer and KV head (a bar per head, uniform C dashed) beside each head's kept-mass curve, a dot
    where its split ends. ``slots``: per layer, one per KV head; ``curves``: per layer, [Hkv, T + 1]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["tab:orange" if w else "tab:blue" for w in windows]
    for layer, heads in enumerate(slots):
        width = 0.8 / len(heads)
        left.bar([layer - 0.4 + width * (h + 0.5) for h in range(len(heads))], heads, width=width,
                 color=colors[layer], edgecolor="white", linewidth=0.3)
    left.set_xticks(range(0, len(slots), max(1, len(slots) // 12)))
    left.axhline(capacity, color="gray", linestyle="--", label=f"uniform C = {capacity}")
    left.set(xlabel="layer, a bar per KV head (blue: full attention, orange: sliding window)", ylabel="slots",
             title="the split")
    left.legend()
    for layer, (curve, heads) in enumerate(zip(curves, slots)):
        for head, n in zip(curve, heads):
            right.plot(range(len(head)), head, color=colors[layer], alpha=0.5, linewidth=0.8)
            right.plot([n], [float(head[min(n, len(head) - 1)])], "o", color=colors[layer], markersize=3)
    right.axvline(capacity, color="gray", linestyle="--")
    right.set(xscale="log", xlabel="slots c", ylabel="attention mass on the c most-attended keys",
              title="what each KV head's queries keep (dots: its split)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
