"""Decode benchmark: H2OModel against transformers' own caches, in one process, plus a memory roofline.

``run_bench(settings)`` returns a JSON-ready dict; ``bench.report.write_bench_report`` writes it as JSON,
markdown and PNG. The CLI (``h2o-compile bench``) and ``benchmarks/decode.py`` call these two.

What is measured, per (model, batch B, total length N):
- decode: the cache of every contender is filled synthetically with ``context = N - steps`` tokens (see
  bench.contenders), then ``steps`` single-token steps run, the last at N tokens. The same token ids and
  positions go to every contender. ``warmup`` steps (which include torch.compile) run first and are not
  timed; then ``repeats`` timed blocks, the contender order reversed every other repeat; after each block the
  cache is restored to ``context`` tokens. Latency p50/p95 pool the steps of all blocks; tokens/s is the
  median over blocks of B x steps / block time.
- prefill: a real forward over a random prompt of ``context`` tokens at batch 1 into a fresh cache (eager for
  every contender; transformers' generate does not compile prefill either).
- memory: cache bytes from tensor sizes; the transient RSS peak above resident during a timed block (Linux
  VmHWM reset through /proc/self/clear_refs); the process peak RSS (ru_maxrss) at the end.
- roofline: (weight bytes + cache bytes read per step) / memory bandwidth measured by a large tensor copy.
"""

from __future__ import annotations

import gc
import math
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .contenders import build_contenders
from .machine import (apply_roofline, cpu_ticks, foreign_cores, measure_bandwidth, peak_memory_kib,
                            reset_peak_memory, roofline_seconds, summarize_bandwidth, synchronize,
                            weight_bytes_per_step)
from .machine import wait_for_quiet as _wait
from ..zoo import MODELS
from ..zoo.loading import load_pretrained
from ..reporting import machine_description

__all__ = ["BenchSettings", "build_model", "headline", "roofline_seconds", "run_bench", "run_decode",
           "run_prefill", "weight_bytes_per_step"]

KVBOUND = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
               intermediate_size=1024, vocab_size=8192, max_position_embeddings=4096)
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256, max_position_embeddings=512)
MODEL_NAMES = ("tiny", "kvbound", "smoke")


@dataclass
class BenchSettings:
    models: list = field(default_factory=lambda: ["tiny", "kvbound"])
    batches: list = field(default_factory=lambda: [1, 8])
    totals: list = field(default_factory=lambda: [1024, 4096])
    budgets: list = field(default_factory=lambda: [0.1, 0.2, 0.5])
    local_budget: float = 0.2
    steps: int = 16
    warmup: int = 3
    repeats: int = 5
    prefill: bool = True
    prefill_repeats: int = 1
    # H2O's prefill cost hardly depends on the budget (it attends over C + T keys, T dominating): time a subset.
    prefill_contenders: list = field(default_factory=lambda: ["hf-dynamic", "hf-static-compile", "h2o-full",
                                                              "h2o@0.2"])
    compile: bool | str = True  # or a torch.compile mode, the same for every compiled contender
    contenders: list | None = None
    bandwidth_mib: int = 512
    seed: int = 0
    profile: bool = False
    # Shared machine: before each measurement wait (up to quiet_wait_s) until other processes use at most
    # quiet_cores cores, and redo a decode configuration up to `retries` times if they disturbed it anyway.
    quiet_cores: float = 0.1
    quiet_wait_s: float = 900.0
    retries: int = 2

    def __post_init__(self):
        if not self.models:
            raise ValueError("models=[]: give at least one model")
        for name in self.models:
            try:
                check_model_name(name)
            except ValueError as err:
                raise ValueError(f"models={self.models}: {err}") from None
        for name in ("batches", "totals"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name}={values} must be positive ints")
        if any(not 0 < b <= 1 for b in self.budgets + [self.local_budget]):
            raise ValueError(f"budgets {self.budgets} / local budget {self.local_budget} must be in (0, 1]")
        if self.steps < 1 or self.warmup < 1 or self.repeats < 1 or self.prefill_repeats < 1:
            raise ValueError("steps, warmup, repeats and prefill_repeats must be >= 1")
        if self.steps * 2 > min(self.totals):
            raise ValueError(f"steps={self.steps} must be at most half the smallest total {min(self.totals)}")


def check_model_name(name: str) -> None:
    """ValueError unless ``name`` is a random benchmark model (MODEL_NAMES), a shipped model, a folder with a
    config.json or a .gguf file."""
    from pathlib import Path

    path = Path(name)
    local = (path / "config.json").is_file() or (path.suffix == ".gguf" and path.is_file())
    if name not in MODEL_NAMES and name not in MODELS and not local:
        raise ValueError(f"model={name!r}: choose from {', '.join(sorted({*MODEL_NAMES, *MODELS}))}, or give a "
                         "local model folder (with a config.json) or .gguf file")


def build_model(name: str, seed: int = 0) -> nn.Module:
    """``kvbound`` or ``smoke`` (random Llamas, seeded), else what ``--model`` loads everywhere: a shipped model
    (``tiny``, ``gemma3-270m``), a local folder or a .gguf file (zoo/loading.py)."""
    if name not in ("kvbound", "smoke"):
        return load_pretrained(name)[0]
    import transformers

    config = transformers.LlamaConfig(**(KVBOUND if name == "kvbound" else SMOKE), initializer_range=0.05)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


# -- harness ---------------------------------------------------------------------------------------------------

def wait_for_quiet(settings: BenchSettings, log=print) -> float:
    return _wait(max(0.0, settings.quiet_wait_s), settings.quiet_cores, log)


def _percentile(values, q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _timed_block(contender, tokens, context: int) -> tuple[list, torch.Tensor]:
    times = []
    logits = None
    for i in range(tokens.shape[1]):
        start = time.perf_counter()
        logits = contender.step(tokens[:, i:i + 1], context + i)
        logits.argmax(-1)  # what a greedy generate does next; the same for everyone
        synchronize(logits.device)
        times.append(time.perf_counter() - start)
    return times, logits


def run_decode(contenders: list, model: nn.Module, batch: int, total: int, settings: BenchSettings,
               bandwidth: float, log=print) -> list[dict]:
    """Time every contender's decode step on identical tokens and context; returns one row per contender."""
    steps = settings.steps
    context = total - steps
    vocab = model.config.vocab_size
    weights = weight_bytes_per_step(model, batch)
    device = next(model.parameters()).device
    # Drawn on the CPU (the same ids on every device), moved once: no host-to-device copy inside a timed step.
    tokens = torch.randint(0, vocab, (batch, steps), generator=torch.Generator().manual_seed(settings.seed))
    tokens = tokens.to(device)
    rows = {}
    for c in contenders:
        start = time.perf_counter()
        c.prepare(batch, total, context, settings.seed)
        prepared = time.perf_counter()
        for i in range(settings.warmup):
            c.step(tokens[:, i % steps:i % steps + 1], context + i)
        c.restore()
        rows[c.name] = dict(contender=c.name, label=c.label, batch=batch, total=total, context=context,
                            steps=steps, capacity=c.capacity, cache_bytes=c.cache_bytes(),
                            fill_s=prepared - start, warmup_s=time.perf_counter() - prepared,
                            blocks=[], transient_peak_kib=[], context_seen=[], context_after=[], finite=True)
    graphs_before = _compiled_graphs()
    ticks0, wall0 = cpu_ticks(), time.perf_counter()
    for r in range(settings.repeats):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for c in order:
            row = rows[c.name]
            gc.collect()
            row["context_seen"].append(c.cached_tokens())
            rss0 = reset_peak_memory(device)
            times, logits = _timed_block(c, tokens, context)
            peak = peak_memory_kib(device)
            if rss0 is not None and peak is not None:
                row["transient_peak_kib"].append(peak - rss0)
            row["finite"] = row["finite"] and bool(torch.isfinite(logits).all())
            row["context_after"].append(c.cached_tokens())
            row["blocks"].append(times)
            c.restore()
    recompiled = _compiled_graphs() - graphs_before  # must stay 0: a timed block that compiles is not a step
    disturbed = foreign_cores(ticks0, cpu_ticks(), time.perf_counter() - wall0)
    out = []
    for c in contenders:
        row = rows[c.name]
        row["compiles_during_timing"] = recompiled
        row["foreign_cores"] = disturbed
        if any(seen != context for seen in row["context_seen"]) or any(
                seen != total for seen in row["context_after"]):
            raise RuntimeError(f"{c.name}: cache held {row['context_seen']} tokens before a block (not {context}) "
                               f"and {row['context_after']} after (not {total})")
        flat = [t for block in row["blocks"] for t in block]
        p50 = _percentile(flat, 0.5)
        kv_read = statistics.mean(c.kv_read_bytes(context + i) for i in range(steps))
        row.update(
            tokens_per_s=statistics.median(batch * len(b) / sum(b) for b in row["blocks"]),
            step_ms_p50=p50 * 1e3, step_ms_p95=_percentile(flat, 0.95) * 1e3,
            weight_bytes=weights, kv_read_bytes=int(kv_read),
            transient_peak_mib=(max(row["transient_peak_kib"]) / 1024 if row["transient_peak_kib"] else None),
            tokens_sha=hash(tuple(tokens.flatten().tolist())) & 0xFFFFFFFF,
            block_ms=[sum(b) * 1e3 for b in row["blocks"]])
        del row["transient_peak_kib"]
        apply_roofline(row, bandwidth)
        out.append(row)
        log(f"    {c.name:18s} {row['tokens_per_s']:9.1f} tok/s  p50 {row['step_ms_p50']:8.2f} ms  "
            f"p95 {row['step_ms_p95']:8.2f} ms  cache {row['cache_bytes'] / 2**20:8.1f} MiB  "
            f"roofline x{row['roofline_ratio']:.2f}  (fill {row['fill_s']:.1f} s, warm-up {row['warmup_s']:.1f} s, "
            f"other processes {disturbed:.2f} cores)")
    return out


def run_prefill(contenders: list, model: nn.Module, total: int, settings: BenchSettings, log=print) -> list[dict]:
    """Batch-1 prefill of ``total - steps`` real tokens per contender (after an untimed 32-token warm-up)."""
    context = total - settings.steps
    gen = torch.Generator().manual_seed(settings.seed + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=gen)
    rows = []
    for c in contenders:
        if not c.prefill_supported or (settings.prefill_contenders and c.name not in settings.prefill_contenders):
            continue
        c.prefill(prompt[:, :min(32, context)], total)
        times = [c.prefill(prompt, total) for _ in range(settings.prefill_repeats)]
        rows.append(dict(contender=c.name, label=c.label, total=total, prompt_tokens=context,
                         prefill_s=statistics.median(times), prefill_tokens_per_s=context / statistics.median(times)))
        c.release()
        log(f"    prefill {c.name:18s} {rows[-1]['prefill_s']:7.3f} s")
    return rows


def profile_step(contender, tokens, context: int, row_limit: int = 15) -> str:
    """torch.profiler table (self CPU time) of one timed block of ``contender``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _timed_block(contender, tokens, context)
    contender.restore()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)


def run_bench(settings: BenchSettings, log=print) -> dict:
    """The whole benchmark; returns the result dict (see bench.report for how it is written)."""
    begin = time.perf_counter()
    waited = wait_for_quiet(settings, log)
    samples = [measure_bandwidth(settings.bandwidth_mib)]
    bw = samples[0]
    log(f"memory bandwidth: copy {bw['copy_gb_s']:.1f} GB/s, read {bw['read_gb_s']:.1f} GB/s "
        "(measured again before every decode configuration and at the end; the roofline uses the median)")
    result = dict(settings=asdict(settings), machine=machine_description(), torch_threads=torch.get_num_threads(),
                  bandwidth=bw, decode=[], prefill=[], skipped=[], profiles={})
    only = set(settings.contenders) if settings.contenders else None
    # Every contender compiles one graph per shape, all on the same code objects (H2OModel._run_graph,
    # LlamaForCausalLM.forward): lift dynamo's per-code recompile limit for this run only.
    with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
        for name in settings.models:
            try:
                model = build_model(name, settings.seed)
            except FileNotFoundError as err:
                log(f"skipping model {name!r}: {err}")
                result["skipped"].append(f"model {name}: {err}")
                continue
            max_pos = model.config.max_position_embeddings
            totals = [t for t in settings.totals if t <= max_pos]
            for t in sorted(set(settings.totals) - set(totals)):
                result["skipped"].append(f"model {name}: total {t} > max_position_embeddings {max_pos}")
                log(f"skipping {name} at total {t}: beyond its {max_pos} positions")
            int8 = only is not None and any(name.endswith("+int8") for name in only)  # asked for by name only
            contenders = build_contenders(model, settings.budgets, settings.local_budget, settings.compile, only,
                                          int8=int8)
            for total in totals:
                if settings.prefill:
                    log(f"[{time.perf_counter() - begin:6.0f} s] {name}: prefill, batch 1, total {total}")
                    waited += wait_for_quiet(settings, log)
                    ticks, start = cpu_ticks(), time.perf_counter()
                    rows = run_prefill(contenders, model, total, settings, log)
                    busy = foreign_cores(ticks, cpu_ticks(), time.perf_counter() - start)
                    result["prefill"].extend(dict(model=name, foreign_cores=busy, **row) for row in rows)
                for batch in settings.batches:
                    for attempt in range(settings.retries + 1):
                        log(f"[{time.perf_counter() - begin:6.0f} s] {name}: decode, batch {batch}, total {total}"
                            + (f" (attempt {attempt + 1})" if attempt else ""))
                        waited += wait_for_quiet(settings, log)
                        samples.append(measure_bandwidth(settings.bandwidth_mib))
                        rows = run_decode(contenders, model, batch, total, settings,
                                          samples[-1]["copy_gb_s"] * 1e9, log)
                        if rows[0]["foreign_cores"] <= settings.quiet_cores:
                            break
                        log(f"    disturbed by other processes ({rows[0]['foreign_cores']:.2f} cores)")
                    result["decode"].extend(dict(model=name, attempts=attempt + 1, **row) for row in rows)
                    if settings.profile and batch == max(settings.batches) and total == max(settings.totals):
                        waited += wait_for_quiet(settings, log)
                        _profile(result, name, contenders, model, batch, total, settings)
                    for c in contenders:
                        c.release()
                    gc.collect()
            del contenders, model
            gc.collect()
    samples.append(measure_bandwidth(settings.bandwidth_mib))
    result["bandwidth"] = summarize_bandwidth(samples)
    result["bandwidth_samples_gb_s"] = [round(s["copy_gb_s"], 2) for s in samples]
    for row in result["decode"]:
        apply_roofline(row, result["bandwidth"]["copy_gb_s"] * 1e9)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["elapsed_s"] = time.perf_counter() - begin
    result["waited_for_quiet_s"] = waited
    result["headline"] = headline(result["decode"], settings)
    return result


def _profile(result, name, contenders, model, batch, total, settings) -> None:
    context = total - settings.steps
    tokens = torch.randint(0, model.config.vocab_size, (batch, settings.steps),
                           generator=torch.Generator().manual_seed(settings.seed))
    for c in contenders:
        if c.name in ("hf-static-compile", f"hf-static-compile@{settings.local_budget:g}",
                      f"local@{settings.local_budget:g}", "h2o@0.2"):
            result["profiles"][f"{name} B={batch} N={total} {c.name}"] = profile_step(c, tokens, context)


def headline(rows: list[dict], settings: BenchSettings) -> dict:
    """The ratios the issue asks for, at the KV-bound model, largest batch and total, budget 0.2."""
    model = "kvbound" if any(r["model"] == "kvbound" for r in rows) else (rows[0]["model"] if rows else None)
    batch, total = max(settings.batches), max(settings.totals)
    at = {r["contender"]: r for r in rows if (r["model"], r["batch"], r["total"]) == (model, batch, total)}
    h2o, local = at.get("h2o@0.2"), at.get(f"local@{settings.local_budget:g}")
    eager, static = at.get("hf-dynamic"), at.get("hf-static-compile")
    if h2o is None:
        return {}
    out = dict(model=model, batch=batch, total=total, h2o_tokens_per_s=h2o["tokens_per_s"],
               h2o_roofline_ratio=h2o["roofline_ratio"])
    if eager:
        out["speedup_vs_eager_full"] = h2o["tokens_per_s"] / eager["tokens_per_s"]
        out["kv_bytes_ratio_vs_full"] = h2o["cache_bytes"] / eager["cache_bytes"]
    if static:
        out["speedup_vs_static_compile"] = h2o["tokens_per_s"] / static["tokens_per_s"]
    if local:
        out["step_ratio_h2o_vs_local"] = h2o["step_ms_p50"] / local["step_ms_p50"]
    floor = at.get(f"hf-static-compile@{settings.local_budget:g}")
    if floor and settings.local_budget == 0.2:
        out["step_ratio_h2o_vs_static_same_slots"] = h2o["step_ms_p50"] / floor["step_ms_p50"]
    return out
