"""The continuous-batching benchmark: one seeded stream of requests arriving over time, served four ways.

The stream: ``requests`` requests, Poisson arrivals at ``rate`` per second (seeded), prompt lengths drawn from
[prompt_min, prompt_max], each its own ``max_new_tokens`` drawn from [new_min, new_max], greedy, EOS respected
(the model's ``eos_token_id``). Every contender serves it in a fresh process, with at most ``rows`` requests
decoding at once; the H2O contenders and transformers' continuous batching warm up before the first arrival (a
server is up before its requests come), transformers' eager ``generate`` needs none:

- ``h2o-continuous``: ``opt.init_continuous_batching(max_batch_size=rows)`` driven step by step; a request
  joins at the first step after it arrives and leaves the step it finishes.
- ``h2o-groups``: ``opt.generate`` on groups of ``rows`` requests in arrival order; a group starts when its
  last request has arrived and the previous group is done, left-padded, and runs until its longest request
  is done (max_new_tokens is the group's largest; a request's own tokens stop at its own limit or EOS).
- ``hf-continuous``: transformers' continuous batching (``model.init_continuous_batching``, paged attention,
  ``max_requests_per_batch=rows``), requests added from the main thread as they arrive.
- ``hf-groups``: transformers' ``generate`` (DynamicCache) on the same groups as h2o-groups.

Per request: latency (finish - arrival), time to first token (first token - arrival), its own new tokens.
Quantiles are nearest-rank: with fewer than 100 requests, p99 is the slowest request.
Per contender: tokens/s and requests/s over the stream's span (first arrival to last finish), peak RSS, and
the peak RSS when the first request finished (memory fixed from the first request to the last).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ..runtime import optimize
from .serve import _FirstToken, left_pad, load_model, random_prompt
from .machine import peak_rss_kib
from ..reporting import markdown_table, plot_lines
from .decode import check_model_name

CONTENDERS = ("h2o-continuous", "h2o-groups", "hf-continuous", "hf-groups")


@dataclass
class ContinuousSettings:
    model: str = "kvbound"
    requests: int = 32
    rate: float = 2.0  # arrivals per second (Poisson)
    prompt_min: int = 64
    prompt_max: int = 3000
    new_min: int = 16
    new_max: int = 512
    rows: int = 8
    budget: float = 0.2
    compile: bool = True  # the H2O contenders' torch.compile
    seed: int = 0
    contenders: list = field(default_factory=lambda: list(CONTENDERS))

    def __post_init__(self):
        check_model_name(self.model)
        bad = [c for c in self.contenders if c not in CONTENDERS]
        if bad or not self.contenders:
            raise ValueError(f"contenders={self.contenders}; choose from {', '.join(CONTENDERS)}")
        for low, high in (("prompt_min", "prompt_max"), ("new_min", "new_max")):
            if not 1 <= getattr(self, low) <= getattr(self, high):
                raise ValueError(f"need 1 <= {low} ({getattr(self, low)}) <= {high} ({getattr(self, high)})")
        for name in ("requests", "rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.rate > 0:
            raise ValueError(f"rate={self.rate} must be > 0 (requests per second)")
        if not 0 < self.budget <= 1:
            raise ValueError(f"budget={self.budget} must be in (0, 1]")

    @property
    def max_seq_len(self) -> int:
        return self.prompt_max + self.new_max

    @property
    def capacity(self) -> int:
        """H2O slots per row and layer: the budget of the longest request the stream can hold, for both H2O
        contenders (so a request keeps the same positions in a group as in the continuous batch)."""
        return max(1, round(self.budget * self.max_seq_len))


@dataclass
class Arrival:
    id: str
    at: float            # seconds after the stream starts
    prompt: list         # token ids
    new_tokens: int      # the request's max_new_tokens


def make_stream(s: ContinuousSettings, vocab: int) -> list[Arrival]:
    """The seeded stream (module docstring), in arrival order."""
    rng, gen = random.Random(s.seed), torch.Generator().manual_seed(s.seed)
    at, stream = 0.0, []
    for i in range(s.requests):
        prompt = random_prompt(rng.randint(s.prompt_min, s.prompt_max), vocab, gen).tolist()
        stream.append(Arrival(f"req_{i}", at, prompt, rng.randint(s.new_min, s.new_max)))
        at += rng.expovariate(s.rate)
    return stream


def _own_tokens(tokens: list, limit: int, eos: set) -> list:
    """A request's tokens as it would get them alone: up to its own limit, and up to and including EOS."""
    tokens = tokens[:limit]
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if stop is None else tokens[:stop + 1]


def _wait_until(t0: float, at: float) -> None:
    delay = t0 + at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _h2o_continuous(model, stream, s, on_first_done):
    opt = optimize(model, budget=s.capacity, compile=s.compile)
    manager = opt.init_continuous_batching(max_batch_size=s.rows, do_sample=False)
    manager.warmup()
    waiting, done = deque(stream), {}
    t0 = time.perf_counter()
    while len(done) < len(stream):
        now = time.perf_counter() - t0
        while waiting and waiting[0].at <= now:
            r = waiting.popleft()
            manager.add_request(r.prompt, request_id=r.id, max_new_tokens=r.new_tokens, record_timestamps=True)
        if manager.running or manager.pending:
            for out in manager.step():
                done[out.request_id] = (out.generated_tokens, out.timestamps[0], out.lifespan[1])
                on_first_done()
        else:
            _wait_until(t0, waiting[0].at)
    return t0, done


def _hf_continuous(model, stream, s, on_first_done):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    # Pages for every row's longest request (no preemption, as H2O's fixed rows), and a step's token budget that
    # takes a whole prompt at once (as H2O's admission prefills it whole).
    page = ContinuousBatchingConfig().page_size
    pages = math.ceil(s.max_seq_len / page) + 1
    config = ContinuousBatchingConfig(max_requests_per_batch=s.rows, num_blocks=s.rows * pages,
                                      max_batch_tokens=max(s.prompt_max, page))
    eos = model.generation_config.eos_token_id
    generation = GenerationConfig(max_new_tokens=s.new_max, do_sample=False, eos_token_id=eos,
                                  pad_token_id=model.generation_config.pad_token_id or 0)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    manager.warmup()
    manager.start()
    waiting, done = deque(stream), {}
    t0 = time.perf_counter()
    try:
        while len(done) < len(stream):
            now = time.perf_counter() - t0
            while waiting and waiting[0].at <= now:
                r = waiting.popleft()
                manager.add_request(r.prompt, request_id=r.id, max_new_tokens=r.new_tokens, record_timestamps=True)
            out = manager.get_result(timeout=0.005)
            if out is not None and out.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed request {out.request_id}: {out.error}")
            if out is not None and out.is_finished():
                done[out.request_id] = (out.generated_tokens, out.timestamps[0], out.lifespan[1])
                on_first_done()
            elif out is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
    finally:
        manager.stop(block=True)
    return t0, done


def _groups(model, stream, s, on_first_done, h2o: bool):
    """Fixed groups of ``rows`` in arrival order, each one left-padded generate (module docstring)."""
    if h2o:
        opt = optimize(model, budget=s.capacity, compile=s.compile)
        opt.generate(torch.tensor([stream[0].prompt[:16]] * s.rows), max_new_tokens=3, do_sample=False)  # warm-up
    pad = model.generation_config.pad_token_id or 0
    done, t0 = {}, time.perf_counter()
    for start in range(0, len(stream), s.rows):
        group = stream[start:start + s.rows]
        _wait_until(t0, group[-1].at)
        ids, mask = left_pad([torch.tensor(r.prompt) for r in group], pad)
        first = _FirstToken()
        kwargs = dict(attention_mask=mask, max_new_tokens=max(r.new_tokens for r in group), do_sample=False,
                      streamer=first, pad_token_id=pad)
        out = (opt if h2o else model).generate(ids, **kwargs)
        finished = time.perf_counter()
        for row, r in enumerate(group):
            done[r.id] = (out[row, ids.shape[1]:].tolist(), first.at, finished)
        on_first_done()
    return t0, done


def run_contender(name: str, s: ContinuousSettings) -> dict:
    """Serve the stream with one contender (call in a fresh process); returns its measurements."""
    torch.manual_seed(s.seed)
    model = load_model(s.model, "cpu", keep_eos=True)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    vocab = int(model.config.vocab_size)
    stream = make_stream(s, vocab)
    first_done_rss = []

    def on_first_done():
        if not first_done_rss:
            first_done_rss.append(peak_rss_kib() or 0)

    serve = {"h2o-continuous": _h2o_continuous, "hf-continuous": _hf_continuous,
             "h2o-groups": lambda *a: _groups(*a, h2o=True), "hf-groups": lambda *a: _groups(*a, h2o=False)}[name]
    with torch.no_grad():
        t0, done = serve(model, stream, s, on_first_done)
    requests = []
    for r in stream:
        tokens, first, finished = done[r.id]
        own = _own_tokens(tokens, r.new_tokens, eos)
        requests.append({"id": r.id, "arrival_s": r.at, "prompt": len(r.prompt), "max_new_tokens": r.new_tokens,
                         "tokens": len(own), "ttft_s": first - t0 - r.at, "latency_s": finished - t0 - r.at,
                         "finish_s": finished - t0, "generated": own})
    span = max(q["finish_s"] for q in requests)
    tokens = sum(q["tokens"] for q in requests)
    latencies = sorted(q["latency_s"] for q in requests)
    ttfts = sorted(q["ttft_s"] for q in requests)
    return {"contender": name, "span_s": span, "tokens": tokens, "tokens_per_s": tokens / span,
            "requests_per_s": len(requests) / span, "p50_latency_s": _quantile(latencies, 0.5),
            "p99_latency_s": _quantile(latencies, 0.99), "p50_ttft_s": _quantile(ttfts, 0.5),
            "p99_ttft_s": _quantile(ttfts, 0.99), "peak_rss_mib": (peak_rss_kib() or 0) / 1024,
            "peak_rss_first_done_mib": first_done_rss[0] / 1024, "requests": requests}


def _quantile(ordered: list, q: float) -> float:
    """The nearest-rank quantile of sorted values."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run_continuous(s: ContinuousSettings, log=print) -> dict:
    """Every contender in its own process (own Inductor cache); the combined result. The generated tokens of
    each request are checked equal across the H2O contenders and across the transformers contenders."""
    results = []
    for name in s.contenders:
        with tempfile.TemporaryDirectory(prefix="h2o-serve-cb-") as tmp:
            out = Path(tmp) / "result.json"
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"))
            log(f"serving the stream with {name} ...")
            subprocess.run([sys.executable, "-m", "h2o_compile.bench.serve_continuous", "--worker", name,
                            "--out", str(out), "--settings", json.dumps(dataclasses.asdict(s))], env=env, check=True)
            results.append(json.loads(out.read_text()))
            log(f"  {name}: {results[-1]['span_s']:.1f} s, {results[-1]['tokens_per_s']:.1f} tokens/s")
    rows = {r["contender"]: r for r in results}
    agreement = {}
    for a, b in (("h2o-continuous", "h2o-groups"), ("hf-continuous", "hf-groups")):
        if a in rows and b in rows:
            same = sum(x["generated"] == y["generated"] for x, y in zip(rows[a]["requests"], rows[b]["requests"]))
            agreement[f"{a} = {b}"] = f"{same}/{len(rows[a]['requests'])}"
    for r in results:
        for q in r["requests"]:
            del q["generated"]
    return {"settings": dataclasses.asdict(s), "results": results, "same_tokens": agreement}


def continuous_report(result: dict, command: str, machine: str) -> str:
    """The markdown page of a run of :func:`run_continuous`, with the issue's targets checked."""
    s, rows = result["settings"], {r["contender"]: r for r in result["results"]}
    settings = ContinuousSettings(**s)
    lines = [f"# Continuous batching on CPU: {s['model']}", "", f"Command: `{command}`  ", f"Machine: {machine}", "",
             f"{s['requests']} requests arriving at {s['rate']}/s (Poisson, seed {s['seed']}), prompts of "
             f"{s['prompt_min']}-{s['prompt_max']} tokens, max_new_tokens {s['new_min']}-{s['new_max']} each, greedy, "
             f"EOS respected; at most {s['rows']} requests decode at once. H2O keeps {settings.capacity} slots per "
             f"row and layer (budget {s['budget']} of {settings.max_seq_len}, the longest request possible), "
             f"compile={s['compile']}. Each contender runs in a fresh process after a warm-up; what each does: "
             "h2o_compile/bench/serve_continuous.py.", ""]
    table = [[name, r["span_s"], r["tokens"], r["tokens_per_s"], r["requests_per_s"], r["p50_latency_s"],
              r["p99_latency_s"], r["p50_ttft_s"], r["p99_ttft_s"], r["peak_rss_first_done_mib"], r["peak_rss_mib"]]
             for name, r in rows.items()]
    lines += [markdown_table(["contender", "span s", "tokens", "tokens/s", "requests/s", "p50 latency s",
                              "p99 latency s", "p50 TTFT s", "p99 TTFT s", "peak RSS at first finish MiB",
                              "peak RSS MiB"], table), ""]
    lines += ["`span`: first arrival to last finish; tokens: each request's own new tokens (to its max_new_tokens "
              "or EOS), summed; latency and TTFT from the request's arrival; p50 / p99 nearest-rank (with fewer "
              "than 100 requests p99 is the slowest request). Same greedy tokens per request: "
              + (", ".join(f"{k}: {v}" for k, v in result["same_tokens"].items()) or "not compared") + ".", "",
              "## Against the targets", ""]
    ours = rows.get("h2o-continuous")
    if ours:
        for theirs, target in (("hf-continuous", 1.5), ("h2o-groups", 1.3)):
            if theirs in rows:
                ratio = ours["tokens_per_s"] / rows[theirs]["tokens_per_s"]
                lines.append(f"- tokens/s vs {theirs}: **{ratio:.2f}x** (target >= {target}x): "
                             f"{'met' if ratio >= target else '**missed**'}")
        if "h2o-groups" in rows:
            p99, theirs = ours["p99_latency_s"], rows["h2o-groups"]["p99_latency_s"]
            lines.append(f"- p99 latency {p99:.1f} s vs h2o-groups {theirs:.1f} s (target: below): "
                         f"{'met' if p99 < theirs else '**missed**'}")
        growth = ours["peak_rss_mib"] / ours["peak_rss_first_done_mib"]
        lines.append(f"- peak RSS at the end / when the first request finished: **{growth:.3f}x** (target <= 1.05x): "
                     f"{'met' if growth <= 1.05 else '**missed**'}")
    return "\n".join(lines) + "\n"


def plot_continuous(result: dict, path: Path) -> None:
    """Each contender's latency distribution: the share of requests done within x seconds of arriving."""
    series = {}
    for r in result["results"]:
        latencies = sorted(q["latency_s"] for q in r["requests"])
        series[r["contender"]] = (latencies, [(i + 1) / len(latencies) for i in range(len(latencies))])
    plot_lines(path, series, xlabel="latency, seconds from arrival to last token", ylabel="share of requests done",
               title=f"{result['settings']['requests']} requests, {result['settings']['model']}")


def _worker_main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True, choices=CONTENDERS)
    parser.add_argument("--settings", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    settings = ContinuousSettings(**json.loads(args.settings))
    Path(args.out).write_text(json.dumps(run_contender(args.worker, settings)))


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
