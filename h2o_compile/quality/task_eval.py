"""Run the retrieval tasks (quality/tasks.py) through H2O caches: every sample under every configuration, greedy,
scored by what the answer contains. One H2OModel per configuration serves all its samples."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from ..config import parse_options
from .tasks import TaskSample, max_new_tokens
from ..runtime import optimize

@dataclass(frozen=True)
class TaskConfig:
    """One cache configuration: ``policy`` at ``budget`` with a score rule (h2o only) and the sliding-layer
    setting. ``policy="full"`` is the full cache (budget ignored)."""

    policy: str
    budget: Union[float, int] = 1.0
    rule: str = "sum"
    compress_sliding: bool = False
    sink_tokens: Optional[int] = None
    recent_ratio: float = 0.5
    kv_dtype: str = "model"  # "int8": quantized kept entries (H2OConfig.kv_dtype)

    def __post_init__(self) -> None:
        if self.policy == "h2o" and "recent_ratio" in parse_options(self.rule):
            raise ValueError(f"rule {self.rule!r}: a task configuration has its own recent_ratio (--recent-ratios); "
                             "recent= belongs to eval --h2o-rules")

    @property
    def label(self) -> str:
        dtype = "" if self.kv_dtype == "model" else f" {self.kv_dtype}"
        if self.policy == "full":
            return "full cache" + dtype
        rule = f" [{self.rule}]" if self.policy == "h2o" else ""
        sinks = f" +{self.sink_tokens} sinks" if self.sink_tokens and self.policy == "h2o" else ""
        recent = f" recent {self.recent_ratio:g}" if self.recent_ratio != 0.5 else ""
        return f"{self.policy}{rule}{sinks}{recent}{dtype}"

    def optimize_kwargs(self) -> dict:
        dtype = {} if self.kv_dtype == "model" else {"kv_dtype": self.kv_dtype}
        if self.policy == "full":
            return dict(budget=1.0, policy="full", **dtype)
        rule = parse_options(self.rule) if self.policy == "h2o" else {}
        return dict(budget=self.budget, policy=self.policy, compress_sliding=self.compress_sliding,
                    sink_tokens=self.sink_tokens, recent_ratio=self.recent_ratio, **rule, **dtype)


@dataclass
class TaskRun:
    """Every sample's score under every configuration, and what was run."""

    rows: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def matching(self, depth_band: Optional[tuple[float, float]] = None, **match) -> list[dict]:
        """The rows whose fields equal ``match`` and, with ``depth_band`` (lo, hi), whose depth lies in [lo, hi)."""
        lo, hi = depth_band if depth_band is not None else (float("-inf"), float("inf"))
        return [r for r in self.rows if lo <= r["depth"] < hi and all(r.get(k) == v for k, v in match.items())]

    def accuracy(self, depth_band: Optional[tuple[float, float]] = None, **match) -> Optional[float]:
        """Mean score of :meth:`matching`'s rows; None when there are none."""
        scores = [r["score"] for r in self.matching(depth_band, **match)]
        return sum(scores) / len(scores) if scores else None


@torch.no_grad()
def run_tasks(model, tokenizer, samples: Sequence[TaskSample], configs: Sequence[TaskConfig], *,
              progress: bool = True, on_config: Optional[Callable[[TaskRun], None]] = None,
              compile: bool = False) -> TaskRun:
    """Greedy answers of every sample under every configuration.

    Args:
        samples: from quality.tasks.make_samples; configs: the caches to compare.
        on_config: called with the run so far after each configuration (an interrupted run keeps them).
    Returns:
        a TaskRun whose rows hold task, length, depth, index, the configuration's fields, score, output and
        kv_bytes (the cache state the answer was generated with: keys, values, scores, positions).
    """
    from tqdm.auto import tqdm

    run = TaskRun()
    start = time.perf_counter()
    bar = tqdm(total=len(samples) * len(configs), desc="tasks", unit="prompt", disable=not progress)
    for config in configs:
        opt = optimize(model, compile=compile, **config.optimize_kwargs())
        for sample in samples:
            ids = torch.tensor([sample.prompt_ids], dtype=torch.long)
            out = opt.generate(ids, max_new_tokens=max_new_tokens(sample.task))
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            run.rows.append(dict(task=sample.task, length=sample.length, depth=round(sample.depth, 4),
                                 index=sample.index, **asdict(config), label=config.label,
                                 score=sample.score(text), output=text, kv_bytes=opt.kv_cache_bytes()))
            bar.update(1)
        run.seconds = time.perf_counter() - start
        if on_config is not None:
            on_config(run)
    bar.close()
    return run
