"""Decode on a GPU: CUDA graphs on and off, and the largest batch that fits a memory cap.

Two measurements on top of the decode harness (bench.run_decode, the same fill, alternation and medians):

- ``graphs``: one model, batch and length; H2OModel eager, compiled without CUDA graphs (mode "default") and
  compiled with them ("reduce-overhead"), beside transformers' StaticCache compiled both ways. A decode
  step is hundreds of small kernels, so on a fast GPU the launches, not the bytes, set its time: graphs
  replay them in one launch.
- ``memory cap``: the paper's mechanism. Under a fixed memory cap (weights + cache + temporaries), a cache
  5x smaller admits a larger batch, and decode throughput grows with the batch. Per contender, the peak
  memory is measured at two small batches (eager: the cache dominates the slope and compiling every probe
  would cost minutes), a line through them predicts the largest batch under the cap, and that batch is then
  run compiled with CUDA graphs, its peak measured (the prediction is lowered and retried if it went over)
  and its decode throughput timed.

On a CPU the same code runs (modes without graphs, RSS for memory) so tests check the harness without a GPU.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .decode import BenchSettings, build_model, run_decode
from .contenders import H2OContender, HFContender
from .machine import measure_bandwidth, parameter_bytes, peak_memory_kib, reset_peak_memory
from ..reporting import machine_description

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class CudaBenchSettings:
    model: str = "kvbound"
    dtype: str = "float16"
    device: str = "cuda"
    batch: int = 8
    total: int = 4096
    budget: float = 0.2
    memory_cap_gib: float = 16.0
    probe_batches: list = field(default_factory=lambda: [1, 8])
    max_batch: int = 4096
    steps: int = 16
    warmup: int = 3
    repeats: int = 5
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if len(self.probe_batches) != 2 or not 1 <= self.probe_batches[0] < self.probe_batches[1]:
            raise ValueError(f"probe_batches={self.probe_batches} must be two increasing batch sizes >= 1")
        if self.memory_cap_gib <= 0 or not 0 < self.budget <= 1:
            raise ValueError(f"memory_cap_gib={self.memory_cap_gib} must be > 0 and budget={self.budget} in (0, 1]")

    def decode_settings(self) -> BenchSettings:
        """The decode harness's settings for one (batch, total) run."""
        return BenchSettings(batches=[self.batch], totals=[self.total], steps=self.steps, warmup=self.warmup,
                             repeats=self.repeats, seed=self.seed, quiet_wait_s=0)


def fit_batch_limit(probes: dict[int, int], cap_bytes: int, max_batch: int) -> int:
    """The largest batch under ``cap_bytes`` on the line through two (batch -> peak bytes) probes, in
    [0, max_batch] (0: not even one row fits)."""
    (b1, n1), (b2, n2) = sorted(probes.items())
    per_row = max((n2 - n1) / (b2 - b1), 1.0)
    fixed = n1 - per_row * b1
    return max(0, min(max_batch, math.floor((cap_bytes - fixed) / per_row)))


def find_max_batch(need_bytes, cap_bytes: int, probe_batches, max_batch: int, retries: int = 3) -> dict:
    """Largest batch whose ``need_bytes(batch, verify)`` stays under ``cap_bytes``: predicted from two probes
    (verify=False), then checked (verify=True) and lowered in proportion to the overshoot while it is over.
    Returns {"batch", "need_bytes", "predicted", "probes", "tries"}; batch 0 when nothing fits."""
    probes = {b: need_bytes(b, False) for b in probe_batches}
    batch = predicted = fit_batch_limit(probes, cap_bytes, max_batch)
    tries = []
    (b1, n1), _ = sorted(probes.items())
    while batch >= 1 and len(tries) <= retries:
        need = need_bytes(batch, True)
        tries.append((batch, need))
        if need <= cap_bytes:
            return dict(batch=batch, need_bytes=need, predicted=predicted, probes=probes, tries=tries)
        per_row = max((need - n1) / max(batch - b1, 1), 1.0)  # the slope the verified run shows
        batch = min(batch - 1, b1 + math.floor((cap_bytes - n1) / per_row))
    return dict(batch=0, need_bytes=None, predicted=predicted, probes=probes, tries=tries)


def measure_need(contender, batch: int, model: nn.Module, weight_bytes: int, s: CudaBenchSettings) -> int:
    """Weights + what the contender holds after its cache is filled + the peak it adds over ``warmup`` decode
    steps at ``batch``. The synthetic fill's own temporaries (full-context random keys) are left out: a real
    prefill would not create them."""
    device = torch.device(s.device)
    context = s.total - s.warmup
    tokens = torch.randint(0, model.config.vocab_size, (batch, s.warmup),
                           generator=torch.Generator().manual_seed(s.seed))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = reset_peak_memory(device)
    contender.prepare(batch, s.total, context, s.seed)
    reset_peak_memory(device)  # the peak window starts with the filled cache allocated
    for i in range(s.warmup):
        contender.step(tokens[:, i:i + 1], context + i)
    peak = peak_memory_kib(device)
    contender.release()
    return weight_bytes + max(0, peak - base) * 1024


def _pairs(model: nn.Module, s: CudaBenchSettings):
    """(name, eager twin for the probes, compiled-with-graphs contender) for the memory-cap runs."""
    return [
        ("hf-static", lambda: HFContender(model, static=True, compile=False, name="hf-static (eager probe)"),
         lambda: HFContender(model, static=True, compile="reduce-overhead", name="hf-static-compile+graphs")),
        ("h2o-full", lambda: H2OContender(model, "full", 1.0, compile=False),
         lambda: H2OContender(model, "full", 1.0, compile="reduce-overhead", name="h2o-full+graphs")),
        (f"h2o@{s.budget:g}", lambda: H2OContender(model, "h2o", s.budget, compile=False),
         lambda: H2OContender(model, "h2o", s.budget, compile="reduce-overhead", name=f"h2o@{s.budget:g}+graphs")),
    ]


def run_memory_cap(model: nn.Module, s: CudaBenchSettings, bandwidth: float, log=print) -> list[dict]:
    """Per contender: the largest batch under the cap and the decode throughput it reaches there."""
    cap = int(s.memory_cap_gib * 2**30)
    weights = parameter_bytes(model)
    rows = []
    for name, make_probe, make_timed in _pairs(model, s):
        probe, timed = make_probe(), make_timed()

        def need(batch, verify, probe=probe, timed=timed):
            return measure_need(timed if verify else probe, batch, model, weights, s)

        start = time.perf_counter()
        found = find_max_batch(need, cap, s.probe_batches, s.max_batch)
        row = dict(contender=name, timed_as=timed.name, cap_bytes=cap, weight_bytes=weights,
                   search_s=time.perf_counter() - start, **found)
        if found["batch"]:
            decode = run_decode([timed], model, found["batch"], s.total, s.decode_settings(), bandwidth, log)[0]
            row.update(tokens_per_s=decode["tokens_per_s"], step_ms_p50=decode["step_ms_p50"],
                       step_ms_p95=decode["step_ms_p95"], capacity=decode["capacity"],
                       cache_bytes=decode["cache_bytes"])
        timed.release()
        log(f"  cap {s.memory_cap_gib:g} GiB, {name}: batch {found['batch']} (predicted {found['predicted']}), "
            f"{row.get('tokens_per_s', 0):.0f} tokens/s")
        rows.append(row)
        del probe, timed
    return rows


def run_graphs(model: nn.Module, s: CudaBenchSettings, bandwidth: float, log=print) -> list[dict]:
    """Decode tokens/s at (batch, total): eager vs compiled vs compiled + CUDA graphs, H2O and transformers."""
    b = f"{s.budget:g}"
    contenders = [HFContender(model, static=False),
                  HFContender(model, static=True, compile="default", name="hf-static-compile"),
                  HFContender(model, static=True, compile="reduce-overhead", name="hf-static-compile+graphs"),
                  H2OContender(model, "h2o", s.budget, compile=False, name=f"h2o@{b} eager"),
                  H2OContender(model, "h2o", s.budget, compile="default", name=f"h2o@{b} compiled"),
                  H2OContender(model, "h2o", s.budget, compile="reduce-overhead", name=f"h2o@{b}+graphs")]
    rows = run_decode(contenders, model, s.batch, s.total, s.decode_settings(), bandwidth, log)
    for c in contenders:
        c.release()
    return rows


def run_cuda_bench(s: CudaBenchSettings, parts=("graphs", "memory_cap"), log=print, after_part=None) -> dict:
    """Both measurements on ``s.device``; a JSON-ready dict (see bench.report.cuda_markdown). ``after_part``
    is called with the result so far after each part (a caller can write it, so a timeout keeps that part)."""
    runs = {"graphs": (run_graphs, f"CUDA graphs on/off, batch {s.batch}, total {s.total}"),
            "memory_cap": (run_memory_cap, f"largest batch under {s.memory_cap_gib:g} GiB")}
    unknown = [p for p in parts if p not in runs]
    if unknown:
        raise ValueError(f"parts={list(parts)}: unknown {unknown}; choose from {', '.join(runs)}")
    device = torch.device(s.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
    begin = time.perf_counter()
    bw = measure_bandwidth(512 if device.type == "cuda" else 64, device=device)
    log(f"{s.device} copy bandwidth {bw['copy_gb_s']:.0f} GB/s")
    model = build_model(s.model, s.seed).to(device=device, dtype=DTYPES[s.dtype])
    result = dict(settings=asdict(s), machine=machine_description(), bandwidth=bw, graphs=[], memory_cap=[])
    with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
        for part in parts:
            run, what = runs[part]
            log(f"[{time.perf_counter() - begin:5.0f} s] {what}")
            result[part] = run(model, s, bw["copy_gb_s"] * 1e9, log)
            result["elapsed_s"] = time.perf_counter() - begin
            if after_part is not None:
                after_part(result)
    result["elapsed_s"] = time.perf_counter() - begin
    return result
