"""The HTTP load benchmark of ``h2o-compile serve`` against the same server without H2O.

A seeded stream of ``requests`` requests with Poisson arrivals at ``rate`` per second goes over 127.0.0.1 to a
server in a subprocess, through the ``openai`` client (streaming, so the first token's time is seen): chat
completions (``api="chat"``) or completions, each a passage of the text of ``prompt_min``-``prompt_max`` words
and its own ``max_tokens`` in [new_min, new_max], greedy. Two servers, one after the other, each alone on the
machine, each warmed up by two requests before the stream:

- ``h2o``: ``h2o-compile serve`` (H2O continuous batching, ``rows`` rows of ``budget`` slots, compiled step);
- ``transformers``: ``transformers serve --continuous-batching`` (paged attention), transformers' own settings.

Measured per server: generated tokens (the streamed text chunks: one per token as both servers stream) / span
(first arrival to last answer), p50 / p99 latency and time to
first token from each request's arrival, errors, and the resident memory of the server's processes (sampled
every 0.5 s): after the warm-up and the first tenth of the stream, and the peak after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from ..reporting import plot_lines
from ..zoo.loading import transformers_id

SERVERS = ("h2o", "transformers")


@dataclass
class HttpLoadSettings:
    model: str = "tiny"
    text: str = "../shared/data/books/war_and_peace.txt"
    api: str = "completions"     # or "chat" (the model needs a chat template)
    requests: int = 200
    rate: float = 2.0            # arrivals per second (Poisson)
    prompt_min: int = 100        # words
    prompt_max: int = 600
    new_min: int = 16
    new_max: int = 128
    rows: int = 8
    budget: int = 256            # H2O slots per row and layer
    max_seq_len: int = 2048      # the longest prompt + max_tokens the H2O server takes
    seed: int = 0


@dataclass
class Request:
    at: float
    prompt: str
    max_tokens: int


def make_stream(s: HttpLoadSettings) -> list[Request]:
    """The seeded stream: passages of the text at random places, Poisson arrival times."""
    words = Path(s.text).read_text(encoding="utf-8", errors="replace").split()
    rng, at, stream = random.Random(s.seed), 0.0, []
    for _ in range(s.requests):
        n = rng.randint(s.prompt_min, s.prompt_max)
        start = rng.randrange(0, len(words) - n)
        stream.append(Request(at, " ".join(words[start:start + n]), rng.randint(s.new_min, s.new_max)))
        at += rng.expovariate(s.rate)
    return stream


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(command: list[str], url: str, startup_s: float, name: str = "the server"):
    """Start ``command`` (a server that will answer ``url``/health), wait until it answers (at most
    ``startup_s`` seconds; RuntimeError with its output if it stops or never answers), yield (process, the
    output lines so far, read in the background), then stop it."""
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True).start()
    try:
        for _ in range(int(startup_s / 0.5)):
            if server.poll() is not None:
                raise RuntimeError(f"{name} stopped: {''.join(lines)[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{name} did not answer /health in {startup_s:g} s")
        yield server, lines
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def server_command(name: str, s: HttpLoadSettings, port: int) -> tuple[list[str], str]:
    """(command line, the model name requests give) of server ``name``."""
    if name == "h2o":
        return ([sys.executable, "-m", "h2o_compile.cli", "serve", "--model", s.model, "--budget", str(s.budget),
                 "--max-batch-size", str(s.rows), "--max-seq-len", str(s.max_seq_len), "--compile", "on",
                 "--port", str(port), "--log-level", "warning"], s.model)
    model = transformers_id(s.model)
    cli = shutil.which("transformers", path=str(Path(sys.executable).parent)) or "transformers"
    return [cli, "serve", model, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--log-level", "warning"], model


class RssSampler:
    """Resident memory of a process and its children, every ``every`` seconds: (time, MiB) pairs."""

    def __init__(self, pid: int, every: float = 0.5):
        import psutil

        self.process, self.samples, self._stop = psutil.Process(pid), [], threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                tree = [self.process, *self.process.children(recursive=True)]
                self.samples.append((time.perf_counter(), sum(p.memory_info().rss for p in tree) / 2**20))
            except psutil.Error:
                pass
            self._stop.wait(every)

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.samples


async def _one(client, s: HttpLoadSettings, model: str, request: Request, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + request.at - time.perf_counter()))
    sent = time.perf_counter()
    first, tokens, error = None, 0, None
    try:
        if s.api == "chat":
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": request.prompt}], max_tokens=request.max_tokens,
                temperature=0, stream=True)
        else:
            stream = await client.completions.create(model=model, prompt=request.prompt,
                                                     max_tokens=request.max_tokens, temperature=0, stream=True)
        async for chunk in stream:
            piece = (chunk.choices[0].delta.content if s.api == "chat" else chunk.choices[0].text) \
                if chunk.choices else None
            if piece:
                first = first or time.perf_counter()
                tokens += 1
    except Exception as exc:  # noqa: BLE001 - an error is a measured outcome, counted and reported
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    return {"sent": sent - t0, "latency": end - sent, "ttft": None if first is None else first - sent,
            "tokens": tokens, "end": end, "error": error}


async def _drive(s: HttpLoadSettings, url: str, model: str, stream: list[Request]) -> tuple[list, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=1800, max_retries=0)
    async with client:
        for request in stream[:2]:  # warm-up, untimed
            await _one(client, s, model, Request(0.0, request.prompt, 8), time.perf_counter())
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, s, model, r, t0) for r in stream))
    return list(results), t0


def run_server(name: str, s: HttpLoadSettings, stream: list[Request], log=print) -> dict:
    """Start server ``name``, send it the stream, stop it; its figures."""
    port = free_port()
    command, model = server_command(name, s, port)
    url = f"http://127.0.0.1:{port}"
    with running_server(command, url, startup_s=600, name=f"{name} server") as (server, lines):  # load + compile
        log(f"{name}: serving on {url}")
        sampler = RssSampler(server.pid)
        results, t0 = asyncio.run(_drive(s, url, model, stream))
        samples = sampler.stop()
    return summarize(name, results, t0, samples, lines)


def _quantile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else float("nan")


def summarize(name: str, results: list, t0: float, samples: list, lines: list) -> dict:
    ok = [r for r in results if r["error"] is None]
    ends = sorted(r["end"] for r in ok)
    span = (max(ends) - t0) if ends else float("nan")
    warm = ends[len(ends) // 10] if ends else t0  # the first tenth of the stream answered
    at_warm = [mib for t, mib in samples if t <= warm]
    after = [mib for t, mib in samples if t > warm]
    memory = next((line.strip() for line in lines if line.startswith("H2O continuous batching")), None)
    return {"server": name, "requests": len(results), "errors": len(results) - len(ok),
            "error_examples": sorted({r["error"] for r in results if r["error"]})[:3],
            "tokens": sum(r["tokens"] for r in ok), "span_s": span,
            "tokens_per_s": sum(r["tokens"] for r in ok) / span if ok else 0.0,
            "p50_latency_s": _quantile([r["latency"] for r in ok], 0.5),
            "p99_latency_s": _quantile([r["latency"] for r in ok], 0.99),
            "p50_ttft_s": _quantile([r["ttft"] for r in ok if r["ttft"] is not None], 0.5),
            "p99_ttft_s": _quantile([r["ttft"] for r in ok if r["ttft"] is not None], 0.99),
            "rss_warm_mib": at_warm[-1] if at_warm else float("nan"),
            "rss_peak_after_mib": max(after) if after else float("nan"),
            "rss_samples": [(round(t - t0, 2), round(m, 1)) for t, m in samples],
            "h2o_memory": memory}


def run_http_load(s: HttpLoadSettings, servers=SERVERS, log=print) -> dict:
    stream = make_stream(s)
    rows = [run_server(name, s, stream, log) for name in servers]
    return {"settings": asdict(s), "rows": rows}


def http_load_report(result: dict, command: str, machine: str) -> str:
    s = result["settings"]
    lines = [f"# HTTP load: {s['model']}, h2o-compile serve vs transformers serve", "", f"Command: `{command}`  ",
             f"Machine: {machine}", "",
             f"{s['requests']} {s['api']} requests, Poisson arrivals at {s['rate']}/s (seed {s['seed']}), prompts of "
             f"{s['prompt_min']}-{s['prompt_max']} words of {Path(s['text']).name}, max_tokens {s['new_min']}-"
             f"{s['new_max']}, greedy, streamed over 127.0.0.1 with the openai client. H2O: {s['rows']} rows of "
             f"{s['budget']} slots (max_seq_len {s['max_seq_len']}), compiled; transformers: "
             "`--continuous-batching` (paged attention) with its defaults. One server at a time.", "",
             "| server | errors | tokens | span s | tokens/s | p50 / p99 latency s | p50 / p99 TTFT s | RSS after "
             "warm-up MiB | peak RSS after MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['server']} | {r['errors']} | {r['tokens']} | {r['span_s']:.1f} | {r['tokens_per_s']:.2f} | "
                     f"{r['p50_latency_s']:.2f} / {r['p99_latency_s']:.2f} | {r['p50_ttft_s']:.2f} / "
                     f"{r['p99_ttft_s']:.2f} | {r['rss_warm_mib']:.0f} | {r['rss_peak_after_mib']:.0f} |")
    by = {r["server"]: r for r in result["rows"]}
    if len(by) == 2:
        h, t = by["h2o"], by["transformers"]
        lines += ["", f"- throughput: **{h['tokens_per_s'] / t['tokens_per_s']:.2f}x** transformers' (target >= 1.5x)",
                  f"- H2O server RSS: peak after warm-up / after warm-up = "
                  f"**{h['rss_peak_after_mib'] / h['rss_warm_mib']:.3f}** (target <= 1.05)",
                  f"- answered: {h['requests'] - h['errors']} / {h['requests']} (H2O), "
                  f"{t['requests'] - t['errors']} / {t['requests']} (transformers)"]
    memory = by.get("h2o", {}).get("h2o_memory")
    if memory:
        lines += ["", f"The H2O server at start: {re.sub(r'[(].*?[)]', '', memory).strip()}"]
    for r in result["rows"]:
        if r["error_examples"]:
            lines += ["", f"{r['server']} errors, e.g.: {'; '.join(r['error_examples'])}"]
    return "\n".join(lines) + "\n"


def plot_http_load(result: dict, path: Path, title: Optional[str] = None) -> None:
    series = {r["server"]: ([t for t, _ in r["rss_samples"]], [m for _, m in r["rss_samples"]])
              for r in result["rows"]}
    plot_lines(path, series, xlabel="seconds since the first arrival", ylabel="server RSS (MiB)",
               title=title or f"{result['settings']['model']}: server memory under the stream")
