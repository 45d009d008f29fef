"""Train the tiny Llama shipped in h2o_compile/assets/tiny-llama (thin CLI over h2o_compile.zoo.train).

    nice -n 15 python benchmarks/train_tiny_lm.py --minutes 40 --threads 2

Defaults: WikiText-2 valid+test and War and Peace from ../shared/data (relative to the repo root's parent),
the last 10% of each file held out, seq_len 1024 x batch 4, torch.compile'd step. The result folder gets
model.safetensors (fp16), config.json, tokenizer files, README.md (model card), train_log.txt and
train_summary.json.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from h2o_compile.zoo.train import TrainConfig, run_training

DEFAULT_DATA = [
    REPO.parent / "shared/data/wikitext-2/valid.txt",
    REPO.parent / "shared/data/wikitext-2/test.txt",
    REPO.parent / "shared/data/books/war_and_peace.txt",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", default=[str(p) for p in DEFAULT_DATA], help="UTF-8 text files")
    ap.add_argument("--out", default=str(REPO / "h2o_compile/assets/tiny-llama"), help="output folder")
    ap.add_argument("--minutes", type=float, default=40.0, help="wall-clock budget of the training loop")
    ap.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop after this many steps and run the cosine schedule over steps (default: over time)",
    )
    ap.add_argument("--seq-len", type=int, default=1024, help="training window (the model's context is 1024)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--heldout-frac", type=float, default=0.1, help="tail fraction of each file held out")
    ap.add_argument("--eval-every", type=int, default=200, help="steps between quick held-out evals")
    ap.add_argument(
        "--no-compile", action="store_true", help="train eagerly (slower; no C++ compiler needed)"
    )
    ap.add_argument("--log-file", default=None, help="default: OUT/train_log.txt")
    args = ap.parse_args(argv)

    cfg = TrainConfig(
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        minutes=args.minutes,
        max_steps=args.max_steps,
        seed=args.seed,
        eval_every=args.eval_every,
        compile=not args.no_compile,
    )
    # Record the command relative to the repo so the card does not leak this machine's paths.
    command = (
        "python "
        + " ".join(
            shlex.quote(a) for a in [str(Path(sys.argv[0]).resolve().relative_to(REPO))] + sys.argv[1:]
        )
        if argv is None
        else "train_tiny_lm.main(" + repr(argv) + ")"
    )
    summary = run_training(
        args.data,
        args.out,
        cfg,
        vocab_size=args.vocab_size,
        heldout_frac=args.heldout_frac,
        threads=args.threads,
        command=command,
        log_path=args.log_file,
    )
    print(
        f"steps {summary['steps']}  tokens {summary['tokens_seen']:,}  "
        f"time {summary['train_seconds']:.0f}s  train ppl {summary['train_eval_ppl']:.2f}  "
        f"held-out ppl {summary['heldout_ppl']:.2f}  weights {summary['weights_bytes']:,} B -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
