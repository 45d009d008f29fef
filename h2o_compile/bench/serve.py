"""The serving benchmark: a stream of requests of new prompt lengths and batch sizes, every compile counted.

Each contender serves the same seeded stream (prompt lengths drawn from [prompt_min, prompt_max], groups of
1..max_batch requests in arrival order, each group one left-padded batch, ``new_tokens`` greedy tokens per
request, EOS ignored so every contender does the same work) in a fresh process with an empty Inductor cache:
its wall time includes every compile, warm-up and CUDA-graph capture it needs. All requests arrive at t = 0,
so a request's latency is the time until its batch is done. With ``inductor_cache="warm"`` each contender
that compiles serves the stream twice in two fresh processes sharing one Inductor cache: the first fills it,
the second (a restarted server) is the measured one; Dynamo still traces, Inductor loads its code from disk.

Contenders: ``h2o-compiled`` / ``h2o-eager`` (H2OModel at the budget; ``h2o-max-autotune``: compiled in
torch.compile's max-autotune mode, which on CPU also freezes and prepacks the weights;
``h2o-compiled-by-layer``: ``regional_compile=True``, each kind of decoder layer compiled once), ``hf-dynamic``
(transformers' generate, eager, DynamicCache) and ``hf-static-compile`` (transformers' generate with a StaticCache
of one max_cache_len for the whole stream and its own torch.compile of the decode step, as its docs recommend for
varying inputs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .decode import build_model, check_model_name
from ..runtime import optimize
from .machine import peak_rss_kib
from ..reporting import markdown_table, plot_lines

CONTENDERS = ("h2o-compiled", "h2o-compiled-by-layer", "h2o-max-autotune", "h2o-eager", "hf-dynamic",
              "hf-static-compile")
_H2O_COMPILE = {"h2o-compiled": True, "h2o-compiled-by-layer": True, "h2o-max-autotune": "max-autotune",
                "h2o-eager": False}
_COMPILED_H2O = tuple(name for name, compile in _H2O_COMPILE.items() if compile)  # the rows the targets are for
COMPILING = (*_COMPILED_H2O, "hf-static-compile")  # the contenders a warm Inductor cache can speed up
INDUCTOR_CACHES = ("cold", "warm")


@dataclass
class ServeSettings:
    model: str = "kvbound"
    requests: int = 64
    prompt_min: int = 64
    prompt_max: int = 3000
    new_tokens: int = 128
    max_batch: int = 8
    budget: float = 0.2
    seed: int = 0
    device: str = "cpu"
    contenders: list = field(default_factory=lambda: list(CONTENDERS))
    # after the stream: requests of prompt lengths the stream never had, each timed twice (new, then repeated)
    probe_lengths: list = field(default_factory=lambda: [333, 1234, 2345])
    probe_batch: int = 4
    inductor_cache: str = "cold"  # "warm": a compiling contender is measured on its second run (module docstring)

    def __post_init__(self):
        check_model_name(self.model)
        bad = [c for c in self.contenders if c not in CONTENDERS]
        if bad or not self.contenders:
            raise ValueError(f"contenders={self.contenders}; choose from {', '.join(CONTENDERS)}")
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise ValueError(f"need 1 <= prompt_min ({self.prompt_min}) <= prompt_max ({self.prompt_max})")
        for name in ("requests", "new_tokens", "max_batch", "probe_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.budget <= 1:
            raise ValueError(f"budget={self.budget} must be in (0, 1]")
        if self.inductor_cache not in INDUCTOR_CACHES:
            raise ValueError(f"inductor_cache={self.inductor_cache!r}; choose from {', '.join(INDUCTOR_CACHES)}")

    @property
    def max_seq_len(self) -> int:
        return max([self.prompt_max, *self.probe_lengths]) + self.new_tokens


def request_batches(settings: ServeSettings, vocab: int) -> list[list[torch.Tensor]]:
    """The stream: groups (1..max_batch, in arrival order) of prompts [P] of seeded lengths and token ids."""
    rng = random.Random(settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)
    prompts = [random_prompt(rng.randint(settings.prompt_min, settings.prompt_max), vocab, gen)
               for _ in range(settings.requests)]
    batches = []
    while prompts:
        size = rng.randint(1, settings.max_batch)
        batches.append(prompts[:size])
        prompts = prompts[size:]
    return batches


def random_prompt(length: int, vocab: int, generator=None) -> torch.Tensor:
    """[length] ordinary token ids of any vocabulary, away from the special ids at its two ends."""
    return torch.randint(8, min(vocab, 32000), (length,), generator=generator)


def left_pad(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] ids and attention mask, left-padded to the longest prompt."""
    longest = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, longest - p.numel():] = p
        mask[row, longest - p.numel():] = 1
    return ids, mask


def load_model(name: str, device: str, keep_eos: bool = False):
    """The named model (bench/decode.py's ``build_model``) in eval mode; without ``keep_eos`` its generation
    stops only at max_new_tokens."""
    model = build_model(name)
    if not keep_eos:
        model.generation_config.eos_token_id = None  # a fixed amount of work per request: no early stop
    return model.to(device).eval()


class Server:
    """One contender: ``generate(ids, mask) -> tokens [B, P + n]`` and the KV bytes its cache holds."""

    def __init__(self, name: str, model, settings: ServeSettings):
        self.name, self.model, self.settings = name, model, settings
        self.kv = []  # per H2O batch: (H2O state bytes, bytes of a cache of every token)
        if name.startswith("h2o"):
            self.h2o = optimize(model, budget=settings.budget, compile=_H2O_COMPILE[name],
                                            regional_compile=name == "h2o-compiled-by-layer")

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Generate for one batch; ``self.first_token.at`` is when its first new token came (the prefill)."""
        n, device = self.settings.new_tokens, self.model.device
        ids, mask = ids.to(device), mask.to(device)
        streamer = _FirstToken()
        self.first_token = streamer
        if self.name.startswith("h2o"):
            out = self.h2o.generate(ids, mask, max_new_tokens=n, do_sample=False, streamer=streamer)
            self.kv.append((self.h2o.kv_cache_bytes(), self.h2o.full_cache_bytes(ids.shape[0], ids.shape[1] + n)))
            return out
        kwargs = dict(attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer)
        if self.name == "hf-static-compile":
            from transformers import CompileConfig

            compile_config = CompileConfig(fullgraph=True, mode="default")
            compile_config._compile_all_devices = True  # transformers' switch to auto-compile off GPU
            kwargs.update(cache_implementation="static", max_cache_len=self.settings.max_seq_len,
                          compile_config=compile_config)
            if device.type == "cuda":
                compile_config.mode = "reduce-overhead"
        return self.model.generate(ids, **kwargs)


class _FirstToken:
    """A generate streamer that notes when the first new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.puts, self.at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_contender(name: str, settings: ServeSettings, progress: bool = True) -> dict:
    """Serve the whole stream with one contender (call in a fresh process); returns its measurements."""
    from tqdm.auto import tqdm

    torch.manual_seed(settings.seed)
    model = load_model(settings.model, settings.device)
    vocab = int(getattr(model.config, "vocab_size", None) or model.get_output_embeddings().out_features)
    batches = request_batches(settings, vocab)
    rss_loaded = peak_rss_kib()
    server = Server(name, model, settings)
    latencies, batch_rows = [], []
    start = time.perf_counter()
    for prompts in tqdm(batches, desc=name, unit="batch", disable=not progress):
        ids, mask = left_pad(prompts)
        t0 = time.perf_counter()
        out = server.generate(ids, mask)
        _sync(model.device)
        done = time.perf_counter()
        if out.shape[1] != ids.shape[1] + settings.new_tokens:
            raise RuntimeError(f"{name} generated {out.shape[1] - ids.shape[1]} tokens, not {settings.new_tokens}")
        latencies += [done - start] * len(prompts)
        batch_rows.append({"batch": len(prompts), "padded_prompt": ids.shape[1], "seconds": done - t0,
                           "prefill_s": server.first_token.at - t0})
        if server.kv:
            batch_rows[-1]["kv_bytes"], batch_rows[-1]["full_kv_bytes"] = server.kv[-1]
    wall = time.perf_counter() - start
    probes = []
    for length in settings.probe_lengths:  # after the stream (warm): a new prompt length, then the same again
        ids, mask = left_pad([random_prompt(length, vocab) for _ in range(settings.probe_batch)])
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            server.generate(ids, mask)
            _sync(model.device)
            times.append(time.perf_counter() - t0)
        probes.append({"prompt": length, "new_s": times[0], "repeat_s": times[1], "ratio": times[0] / times[1]})
    tokens = settings.requests * settings.new_tokens
    ordered = sorted(latencies)
    return {
        "contender": name, "wall_s": wall, "tokens_per_s": tokens / wall,
        "p50_latency_s": ordered[len(ordered) // 2], "p95_latency_s": ordered[min(len(ordered) - 1,
                                                                                   int(0.95 * len(ordered)))],
        "peak_rss_mib": (peak_rss_kib() or 0) / 1024, "rss_after_load_mib": (rss_loaded or 0) / 1024,
        "prefill_s": sum(b["prefill_s"] for b in batch_rows),
        "compiled_graphs": _unique_graphs(), "inductor_cache_hits": _inductor_cache_hits(),
        "batches": batch_rows, "probes": probes,
    }


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _inductor_cache_hits() -> int:
    """Compiled graphs Inductor loaded from its on-disk cache instead of generating and compiling them."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"])


def run_serve(settings: ServeSettings, log=print) -> dict:
    """Every contender in its own process, with its own Inductor cache (empty, or with
    ``inductor_cache="warm"`` filled by a first run of the stream whose wall time becomes ``cold_wall_s``);
    returns the combined result."""
    results = []
    for name in settings.contenders:
        with tempfile.TemporaryDirectory(prefix="h2o-serve-") as tmp:
            out = Path(tmp) / "result.json"
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"))
            cmd = [sys.executable, "-m", "h2o_compile.bench.serve", "--worker", name, "--out", str(out),
                   "--settings", json.dumps(dataclasses.asdict(settings))]
            cold_wall = None
            if settings.inductor_cache == "warm" and name in COMPILING:
                log(f"serving the stream with {name} to fill its Inductor cache ...")
                subprocess.run(cmd, env=env, check=True)
                cold_wall = json.loads(out.read_text())["wall_s"]
            log(f"serving the stream with {name} ...")
            subprocess.run(cmd, env=env, check=True)
            results.append(json.loads(out.read_text()))
            if cold_wall is not None:
                results[-1]["cold_wall_s"] = cold_wall
            log(f"  {name}: {results[-1]['wall_s']:.1f} s, {results[-1]['tokens_per_s']:.1f} tokens/s")
    return {"settings": dataclasses.asdict(settings), "results": results}


# Wall-time speed-ups of the compiled H2O rows the report checks by default: (vs hf-dynamic, vs hf-static-compile).
DEFAULT_TARGETS = (3.0, 1.5)


def decode_tokens_per_s(row: dict, new_tokens: int) -> float:
    """Tokens after the first of each request over the time after each batch's first token."""
    decode_s = sum(b["seconds"] - b["prefill_s"] for b in row["batches"])
    return sum(b["batch"] for b in row["batches"]) * (new_tokens - 1) / decode_s


def kv_ratios(row: dict) -> tuple[float, float] | None:
    """(largest per-batch, whole-stream) ratio of H2O state bytes to a cache of every token; None for a
    contender that does not report them (transformers' caches)."""
    batches = [b for b in row["batches"] if "kv_bytes" in b]
    if not batches:
        return None
    return (max(b["kv_bytes"] / b["full_kv_bytes"] for b in batches),
            sum(b["kv_bytes"] for b in batches) / sum(b["full_kv_bytes"] for b in batches))


def serve_report(result: dict, command: str, machine: str, targets: tuple[float, float] = DEFAULT_TARGETS) -> str:
    """The markdown page of a run of :func:`run_serve`; ``targets``: the total wall-time speed-ups of
    compiled H2O rows over hf-dynamic and hf-static-compile the page checks."""
    s, rows = result["settings"], {r["contender"]: r for r in result["results"]}
    lines = [f"# Serving a request stream on {s['device'].upper()}: {s['model']}", "",
             f"Command: `{command}`  ", f"Machine: {machine}", "",
             f"{s['requests']} requests, prompt lengths drawn from {s['prompt_min']}-{s['prompt_max']} (seed "
             f"{s['seed']}), {s['new_tokens']} new tokens each (EOS ignored), batched in arrival order in groups "
             f"of 1-{s['max_batch']} (left-padded); all arrive at t = 0, so latency = time until the request's "
             f"batch is done. {_cache_sentence(s.get('inductor_cache', 'cold'))} H2O budget {s['budget']}.", ""]
    base = {k: rows[k]["wall_s"] for k in ("hf-dynamic", "hf-static-compile") if k in rows}
    table = []
    for name, r in rows.items():
        worst = max((p["ratio"] for p in r["probes"]), default=float("nan"))
        kv = kv_ratios(r)
        table.append([name, r["wall_s"], r["tokens_per_s"], *[base[k] / r["wall_s"] if k in base else "-"
                                                              for k in ("hf-dynamic", "hf-static-compile")],
                      r["prefill_s"], decode_tokens_per_s(r, s["new_tokens"]), r["p50_latency_s"],
                      r["p95_latency_s"], r["peak_rss_mib"], *(kv if kv else ("-", "-")), r["compiled_graphs"],
                      worst])
    lines += [markdown_table(["contender", "wall s", "tokens/s", "x hf-dynamic", "x hf-static-compile",
                              "prefill s", "decode tokens/s", "p50 latency s", "p95 latency s", "peak RSS MiB",
                              "KV / full, worst batch", "KV / full, stream", "graphs compiled",
                              "new / repeated length"], table), ""]
    lines += ["`prefill s`: the stream's time to first token, summed over batches; `decode tokens/s`: every "
              "token after a request's first over the rest of the time (a compile at the first decode step "
              "counts there). `KV / full`: H2O state bytes over a cache of every token of every layer, for the "
              "batch where the ratio is largest and over the whole stream (bytes summed over batches). "
              "`new / repeated length`: after the stream, a batch of "
              f"{s['probe_batch']} prompts of a length the stream never had ({', '.join(map(str, s['probe_lengths']))})"
              " is served twice; the worst ratio of the first call's time to the second's."
              + (f" Note: {result['kv_bytes_note']}." if result.get("kv_bytes_note") else ""), ""]
    cold = [f"{name} {r['cold_wall_s']:.1f} s (warm: {r['wall_s']:.1f} s, {r.get('inductor_cache_hits', '?')} "
            "graphs loaded from the cache)" for name, r in rows.items() if "cold_wall_s" in r]
    if cold:
        lines += [f"The runs that filled the caches (wall time with an empty cache): {'; '.join(cold)}.", ""]
    lines += ["## Against the targets", ""]
    for ours in _COMPILED_H2O:
        if ours not in rows:
            continue
        r = rows[ours]
        for theirs, target in zip(("hf-dynamic", "hf-static-compile"), targets):
            if theirs in rows:
                ratio = rows[theirs]["wall_s"] / r["wall_s"]
                verdict = "met" if ratio >= target else "**missed**"
                lines.append(f"- {ours} total wall time vs {theirs}: **{ratio:.2f}x** faster (target >= {target}x): "
                             f"{verdict}")
        worst = max(p["ratio"] for p in r["probes"])
        lines.append(f"- {ours}, new prompt length / repeated: **{worst:.2f}x** (target <= 1.3x): "
                     f"{'met' if worst <= 1.3 else '**missed**'}")
        kv = kv_ratios(r)
        if kv:
            lines.append(f"- {ours}, KV bytes / full cache: **{kv[1]:.3f}x** over the stream, {kv[0]:.3f}x in the "
                         f"worst batch (target <= 0.25x): {'met' if kv[1] <= 0.25 else '**missed**'} over the "
                         f"stream, {'met' if kv[0] <= 0.25 else '**missed**'} in every batch")
    return "\n".join(lines) + "\n"


def _cache_sentence(inductor_cache: str) -> str:
    if inductor_cache == "warm":
        return ("Each contender runs in a fresh process; a contender that compiles finds its Inductor cache filled "
                "by an earlier run of the same stream (a restarted server): Dynamo still traces, Inductor loads "
                "the compiled code from disk.")
    return "Each contender runs in a fresh process with an empty Inductor cache: wall time includes every compile."


def plot_serve(result: dict, path: Path) -> None:
    """Seconds since the stream started after each batch, one line per contender (compiles show as steps)."""
    series = {}
    for r in result["results"]:
        elapsed, xs, ys = 0.0, [], []
        for i, b in enumerate(r["batches"]):
            elapsed += b["seconds"]
            xs.append(i + 1)
            ys.append(elapsed)
        series[r["contender"]] = (xs, ys)
    plot_lines(path, series, xlabel="batches served", ylabel="seconds since the stream started",
               title=f"Serving {result['settings']['requests']} requests: {result['settings']['model']}")


def _worker_main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True, choices=CONTENDERS)
    parser.add_argument("--settings", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    settings = ServeSettings(**json.loads(args.settings))
    Path(args.out).write_text(json.dumps(run_contender(args.worker, settings)))


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
