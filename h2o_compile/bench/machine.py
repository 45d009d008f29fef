"""The machine side of the decode benchmark: process memory, CPU taken by other processes, memory bandwidth
and the roofline arithmetic."""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> int | None:
    """Reset VmHWM to the current RSS; returns the current RSS in KiB (None where unsupported)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_kib("VmRSS")


def peak_rss_kib() -> int | None:
    return _status_kib("VmHWM")


def synchronize(device: torch.device) -> None:
    """Wait for the device: CUDA work returns before its kernels finish (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> int | None:
    """Start a peak-memory window; returns the memory in use now in KiB (CUDA: allocated by torch; CPU: RSS)."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) // 1024
    return reset_peak_rss()


def peak_memory_kib(device: torch.device) -> int | None:
    """The peak since ``reset_peak_memory``, in KiB, measured the same way."""
    synchronize(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) // 1024
    return peak_rss_kib()


def cpu_ticks() -> tuple[int, int]:
    """(busy ticks of the whole machine, ticks of this process) from /proc: their difference over an
    interval is CPU time other processes took, i.e. how much the measurement was disturbed."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return user + nice + system + irq + softirq + steal, int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return 0, 0


def foreign_cores(before: tuple[int, int], after: tuple[int, int], seconds: float) -> float:
    """Average number of cores other processes kept busy between two ``cpu_ticks`` readings."""
    ticks = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, ticks / os.sysconf("SC_CLK_TCK") / seconds) if seconds > 0 else 0.0


def wait_for_quiet(max_wait_s: float, quiet_cores: float, log=print) -> float:
    """Sleep until other processes use at most ``quiet_cores`` cores over a 2 s window (or until ``max_wait_s``
    passed); returns the seconds waited."""
    waited, said = 0.0, False
    while waited < max_wait_s:
        before, start = cpu_ticks(), time.perf_counter()
        time.sleep(2.0)
        busy = foreign_cores(before, cpu_ticks(), time.perf_counter() - start)
        if busy <= quiet_cores:
            break
        if not said:
            log(f"    other processes use {busy:.2f} cores: waiting for quiet (up to {max_wait_s:.0f} s)")
            said = True
        waited += time.perf_counter() - start
    return waited


def measure_bandwidth(mib: int = 512, repeats: int = 5, device: torch.device | str = "cpu") -> dict:
    """Best-of-``repeats`` copy of a ``mib`` MiB fp32 tensor: GB/s counting read + write (STREAM copy)."""
    device = torch.device(device)
    n = mib * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    copy = []
    read = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        copy.append(time.perf_counter() - start)
        start = time.perf_counter()
        src.sum()
        synchronize(device)
        read.append(time.perf_counter() - start)
    nbytes = n * 4
    return {"bytes": nbytes, "copy_gb_s": 2 * nbytes / min(copy) / 1e9, "read_gb_s": nbytes / min(read) / 1e9,
            "repeats": repeats}


def summarize_bandwidth(samples: list[dict]) -> dict:
    """The median over measurements taken through the run (a VM's bandwidth drifts with its neighbours)."""
    copy = [s["copy_gb_s"] for s in samples]
    return {"bytes": samples[0]["bytes"], "repeats": samples[0]["repeats"], "samples": len(samples),
            "copy_gb_s": statistics.median(copy), "copy_gb_s_min": min(copy), "copy_gb_s_max": max(copy),
            "read_gb_s": statistics.median(s["read_gb_s"] for s in samples)}


def apply_roofline(row: dict, bandwidth_bytes_s: float) -> None:
    """Set a decode row's roofline time and ratio from its weight and cache bytes."""
    row["roofline_ms"] = roofline_seconds(row["weight_bytes"], row["kv_read_bytes"], bandwidth_bytes_s) * 1e3
    row["roofline_ratio"] = row["step_ms_p50"] / row["roofline_ms"]


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each counted once (tied weights are one tensor)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def weight_bytes_per_step(model: nn.Module, batch: int) -> int:
    """Parameter bytes one decode step reads: every weight once, but only B rows of an untied embedding."""
    total = parameter_bytes(model)
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight is not emb:
        total += batch * emb.shape[1] * emb.element_size() - emb.numel() * emb.element_size()
    return total


def roofline_seconds(weight_bytes: int, kv_bytes: int, bandwidth_bytes_s: float) -> float:
    """Lower bound on one decode step: every byte it must read, streamed once at ``bandwidth``."""
    return (weight_bytes + kv_bytes) / bandwidth_bytes_s
