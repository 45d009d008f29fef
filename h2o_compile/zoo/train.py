"""Train the tiny Llama that ships in ``h2o_compile/assets/tiny-llama`` (CLI: ``benchmarks/train_tiny_lm.py``).

Pipeline (:func:`run_training`): read the corpus and hold out the tail of each file -> train a byte-level BPE
tokenizer on the training part -> build a small GQA Llama -> AdamW with warmup + cosine decay on random
contiguous windows, fp32 on CPU, under a wall-clock budget -> save fp16 safetensors + tokenizer -> reload the
saved weights in fp32, measure train / held-out perplexity -> write the model card (``README.md``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# Re-exported so the whole recipe is importable from one module.
from .arch import FP16_BUDGET_BYTES, build_llama_config, llama_param_count
from .data import clean_text, encode_stream, read_corpus, sha256_file, split_heldout, train_tokenizer
from .card import write_model_card

__all__ = [
    "FP16_BUDGET_BYTES",
    "TrainConfig",
    "TrainResult",
    "build_llama_config",
    "clean_text",
    "encode_stream",
    "evaluate",
    "llama_param_count",
    "read_corpus",
    "run_training",
    "sample_batch",
    "save_fp16",
    "split_heldout",
    "train_model",
    "train_tokenizer",
]


@dataclass
class TrainConfig:
    """Hyper-parameters of one training run; validated on construction (ValueError names the field)."""

    seq_len: int = 1024
    batch_size: int = 4
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    minutes: float = 40.0  # wall-clock budget of the training loop (evals included)
    max_steps: int | None = None  # None: the cosine schedule follows elapsed time instead of steps
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 16  # periodic held-out eval uses this many evenly spaced windows
    compile: bool = False  # torch.compile the training step: faster steps after a compile of tens of seconds

    def __post_init__(self):
        for name in ("seq_len", "batch_size", "log_every", "eval_every", "eval_windows"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"need lr > 0 and 0 <= min_lr_ratio <= 1, got {self.lr!r}, {self.min_lr_ratio!r}"
            )
        if self.minutes <= 0:
            raise ValueError(f"TrainConfig.minutes must be > 0, got {self.minutes!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"TrainConfig.max_steps must be None or >= 1, got {self.max_steps!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"TrainConfig.warmup_steps must be >= 0, got {self.warmup_steps!r}")


def sample_batch(stream: np.ndarray, seq_len: int, batch_size: int, bos_id: int, rng: np.random.Generator):
    """Random contiguous windows. Returns (inputs, targets), both int64 [B, seq_len].

    Each row predicts ``seq_len`` consecutive stream tokens from ``[bos] + those tokens[:-1]``: every window
    starts with bos exactly like tokenizer output at inference, so position 0 is always the same token.
    """
    if len(stream) < seq_len + 1:
        raise ValueError(f"token stream has {len(stream)} tokens, need more than seq_len={seq_len}")
    starts = rng.integers(0, len(stream) - seq_len + 1, size=batch_size)
    targets = np.stack([stream[s : s + seq_len] for s in starts]).astype(np.int64)  # [B, S]
    inputs = np.concatenate([np.full((batch_size, 1), bos_id, np.int64), targets[:, :-1]], axis=1)
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def lr_factor(step: int, progress: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr: linear warmup over steps, times cosine decay over ``progress`` in [0, 1]."""
    warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return warm * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


@torch.inference_mode()
def evaluate(
    model, stream: np.ndarray, seq_len: int, bos_id: int, max_windows: int | None = None, batch_size: int = 8
) -> tuple[float, int]:
    """Mean next-token NLL (nats) over non-overlapping ``seq_len`` windows of ``stream``, in fp32.

    Every stream token is predicted exactly once (windows are prefixed with bos, as in training); the last,
    shorter window is included. ``max_windows`` evaluates evenly spaced windows only (for quick periodic
    checks). Returns (mean_nll, number_of_predicted_tokens).
    """
    n_windows = math.ceil(len(stream) / seq_len)
    if n_windows == 0:
        raise ValueError("cannot evaluate on an empty token stream")
    idx = np.arange(n_windows)
    if max_windows is not None and max_windows < n_windows:
        idx = np.unique(np.linspace(0, n_windows - 1, max_windows).round().astype(int))
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    # Group windows by length so the short tail window gets its own batch instead of padding.
    windows = [stream[i * seq_len : (i + 1) * seq_len].astype(np.int64) for i in idx]
    for length in sorted({len(w) for w in windows}, reverse=True):
        same = [w for w in windows if len(w) == length]
        for b in range(0, len(same), batch_size):
            targets = torch.from_numpy(np.stack(same[b : b + batch_size]))  # [B, L]
            inputs = torch.cat([torch.full_like(targets[:, :1], bos_id), targets[:, :-1]], dim=1)
            logits = model(input_ids=inputs).logits.float()  # [B, L, V]
            total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            count += targets.numel()
    model.train(was_training)
    return total / count, count


@dataclass
class TrainResult:
    steps: int = 0
    tokens_seen: int = 0
    seconds: float = 0.0
    final_train_loss: float = float("nan")  # mean step loss over the last `tail` steps
    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out nll)


def _param_groups(model, weight_decay: float):
    # Decay matrices only: decaying RMSNorm gains toward 0 just fights the normalization.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_model(
    model,
    train_stream: np.ndarray,
    heldout_stream: np.ndarray | None,
    bos_id: int,
    cfg: TrainConfig,
    log_path: str | Path | None = None,
    progress_bar: bool = True,
) -> TrainResult:
    """Train ``model`` in place (fp32) until ``cfg.max_steps`` or ``cfg.minutes`` run out, whichever is first.

    Logs ``step, loss, lr, tokens/s, elapsed`` every ``cfg.log_every`` steps to ``log_path`` (appended) and
    a held-out NLL every ``cfg.eval_every`` steps. Reproducible for a given seed and step count (the batch
    order comes from ``numpy.random.Generator(seed)``); with a time budget only, the step count and so the
    lr schedule depend on the machine's speed.
    """
    from tqdm.auto import tqdm

    rng = np.random.default_rng(cfg.seed)
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    budget = cfg.minutes * 60.0
    result = TrainResult()
    model.train()
    bar = tqdm(total=cfg.max_steps, unit="step", disable=not progress_bar, dynamic_ncols=True)
    t0 = last_t = time.perf_counter()
    last_tokens, window = 0, []

    def loss_fn(inputs, targets):
        logits = model(input_ids=inputs).logits  # [B, S, V]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # Inductor fuses the many small elementwise ops (RMSNorm, RoPE, SiLU, their backwards) that dominate
    # a model this thin on CPU; shapes are fixed, so it compiles once. Evaluation stays eager.
    step_loss = torch.compile(loss_fn, dynamic=False) if cfg.compile else loss_fn

    def write(line: str):
        # Open per line (a few hundred lines per run): the log is complete even if the run is killed.
        if log_path:
            with open(log_path, "a") as f:
                f.write(line + "\n")

    write(
        f"# start {time.strftime('%Y-%m-%d %H:%M:%S')} cfg={json.dumps(asdict(cfg))} "
        f"train_tokens={len(train_stream)} threads={torch.get_num_threads()}"
    )
    while True:
        elapsed = time.perf_counter() - t0
        step = result.steps
        if (cfg.max_steps is not None and step >= cfg.max_steps) or elapsed >= budget:
            break
        progress = step / cfg.max_steps if cfg.max_steps else elapsed / budget
        lr = cfg.lr * lr_factor(step, progress, cfg.warmup_steps, cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, targets = sample_batch(train_stream, cfg.seq_len, cfg.batch_size, bos_id, rng)
        loss = step_loss(inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()

        loss_val = loss.item()
        if not math.isfinite(loss_val):
            write(f"# stop: non-finite loss {loss_val} at step {step}")
            raise FloatingPointError(f"training diverged: loss {loss_val} at step {step}; lower --lr")
        result.steps += 1
        result.tokens_seen += targets.numel()
        result.losses.append(loss_val)
        window.append(loss_val)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_val:.3f}", lr=f"{lr:.1e}", refresh=False)
        if result.steps % cfg.log_every == 0:
            now = time.perf_counter()
            tps = (result.tokens_seen - last_tokens) / max(now - last_t, 1e-9)
            write(
                f"step {result.steps} loss {np.mean(window):.4f} lr {lr:.3e} tok/s {tps:.0f} "
                f"elapsed {now - t0:.1f}s tokens {result.tokens_seen}"
            )
            last_t, last_tokens, window = now, result.tokens_seen, []
        if heldout_stream is not None and result.steps % cfg.eval_every == 0:
            nll, _ = evaluate(model, heldout_stream, cfg.seq_len, bos_id, max_windows=cfg.eval_windows)
            result.evals.append((result.steps, nll))
            write(
                f"eval step {result.steps} heldout_nll {nll:.4f} heldout_ppl {math.exp(nll):.2f} "
                f"elapsed {time.perf_counter() - t0:.1f}s"
            )
            last_t = time.perf_counter()  # keep eval time out of the next tokens/s figure
    bar.close()
    result.seconds = time.perf_counter() - t0
    tail = result.losses[-50:]
    result.final_train_loss = float(np.mean(tail)) if tail else float("nan")
    write(
        f"# end steps={result.steps} tokens={result.tokens_seen} seconds={result.seconds:.1f} "
        f"final_train_loss={result.final_train_loss:.4f}"
    )
    return result


def save_fp16(model, tokenizer, out_dir: str | Path) -> Path:
    """Save fp16 ``model.safetensors`` + ``config.json`` + tokenizer files into ``out_dir``.

    The in-memory model is not modified (an fp16 copy is saved). Returns the weights file path.
    """
    import copy

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(model).to(torch.float16)
    half.config.dtype = torch.float16
    half.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out / "model.safetensors"


def run_training(
    data: list[str],
    out_dir: str | Path,
    cfg: TrainConfig,
    *,
    vocab_size: int = 8192,
    heldout_frac: float = 0.1,
    model_kwargs: dict | None = None,
    threads: int | None = None,
    command: str = "",
    log_path: str | Path | None = None,
    train_eval_windows: int = 128,
    progress_bar: bool = True,
) -> dict:
    """The full pipeline; writes the asset folder ``out_dir`` and returns the summary recorded in its card."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path) if log_path else out / "train_log.txt"
    log_path.write_text("")

    train_texts, heldout_texts = read_corpus(data, heldout_frac=heldout_frac)
    tokenizer = train_tokenizer(
        train_texts,
        vocab_size=vocab_size,
        max_length=(model_kwargs or {}).get("max_position_embeddings", 1024),
    )
    train_stream = encode_stream(tokenizer, train_texts)
    heldout_stream = encode_stream(tokenizer, heldout_texts)
    bos = tokenizer.bos_token_id
    config = build_llama_config(
        len(tokenizer), bos, tokenizer.eos_token_id, tokenizer.pad_token_id, **(model_kwargs or {})
    )
    if cfg.seq_len > config.max_position_embeddings:
        raise ValueError(
            f"seq_len {cfg.seq_len} exceeds max_position_embeddings {config.max_position_embeddings}"
        )
    model = LlamaForCausalLM(config).float()
    model.set_attn_implementation("sdpa")
    n_params = sum(p.numel() for p in model.parameters())

    result = train_model(model, train_stream, heldout_stream, bos, cfg, log_path, progress_bar)
    weights = save_fp16(model, tokenizer, out)

    # Measure what ships: the saved fp16 weights, loaded back in fp32.
    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    heldout_nll, heldout_tokens = evaluate(shipped, heldout_stream, cfg.seq_len, bos)
    train_nll, train_tokens = evaluate(
        shipped, train_stream, cfg.seq_len, bos, max_windows=train_eval_windows
    )
    summary = {
        "command": command,
        "corpus": [
            {"path": str(p), "sha256": sha256_file(p), "train_chars": len(a), "heldout_chars": len(b)}
            for p, a, b in zip(data, train_texts, heldout_texts)
        ],
        "heldout_frac": heldout_frac,
        "train_stream_tokens": len(train_stream),
        "heldout_stream_tokens": len(heldout_stream),
        "vocab_size": len(tokenizer),
        "parameters": n_params,
        "weights_bytes": weights.stat().st_size,
        "config": {
            k: getattr(config, k)
            for k in (
                "num_hidden_layers",
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "max_position_embeddings",
                "tie_word_embeddings",
            )
        },
        "train_config": asdict(cfg),
        "threads": torch.get_num_threads(),
        "steps": result.steps,
        "tokens_seen": result.tokens_seen,
        "epochs": result.tokens_seen / max(len(train_stream), 1),
        "train_seconds": result.seconds,
        "final_train_loss": result.final_train_loss,
        "final_train_ppl": math.exp(result.final_train_loss)
        if math.isfinite(result.final_train_loss)
        else None,
        "train_eval_nll": train_nll,
        "train_eval_ppl": math.exp(train_nll),
        "train_eval_tokens": train_tokens,
        "heldout_nll": heldout_nll,
        "heldout_ppl": math.exp(heldout_nll),
        "heldout_eval_tokens": heldout_tokens,
        "evals": result.evals,
        "versions": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__,
        },
        "date": time.strftime("%Y-%m-%d"),
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_model_card(out, summary)
    return summary
