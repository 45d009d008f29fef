"""Serving benchmark: a seeded stream of requests (new prompt lengths, batch sizes 1-8) through H2OModel
(compiled and eager) and transformers' generate (DynamicCache; StaticCache + torch.compile), every compile
counted. What is measured: h2o_compile/bench/serve.py.

    python benchmarks/serve.py                          # KV-bound model -> docs/results/serve_cpu.{json,md,png}
    python benchmarks/serve.py --model gemma3-270m      # the real model -> docs/results/serve_cpu_gemma3.*
    python benchmarks/serve.py --smoke                  # small sizes, a minute, output under /tmp
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from h2o_compile.cli.arguments import csv_of  # noqa: E402
from h2o_compile.bench.serve import (CONTENDERS, DEFAULT_TARGETS, INDUCTOR_CACHES, ServeSettings,  # noqa: E402
                                     plot_serve, run_serve, serve_report)
from h2o_compile.reporting import command_line, machine_description, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kvbound", help="kvbound or smoke (random Llamas), tiny, gemma3-270m, "
                   "or a local model folder / .gguf file")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-min", type=int, default=64)
    p.add_argument("--prompt-max", type=int, default=3000)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--inductor-cache", choices=INDUCTOR_CACHES, default="cold",
                   help="cold: every compile counted (default); warm: a compiling contender is measured on a second "
                        "run of the stream, its Inductor cache filled by the first (a restarted server)")
    p.add_argument("--smoke", action="store_true", help="smoke model, 6 short requests, output under /tmp")
    p.add_argument("--out", help="output prefix (default docs/results/serve_<device>[_gemma3])")
    p.add_argument("--from-json", help="only rewrite the markdown and plot of an earlier run's JSON")
    p.add_argument("--targets", type=csv_of(float), default=list(DEFAULT_TARGETS),
                   help="wall-time speed-ups of h2o-compiled the page checks: vs hf-dynamic,vs hf-static-compile "
                        f"({','.join(map(str, DEFAULT_TARGETS))})")
    args = p.parse_args(argv)
    if len(args.targets) != 2 or min(args.targets) <= 0:
        p.error(f"--targets takes two positive speed-ups (vs hf-dynamic, vs hf-static-compile), got {args.targets}")
    settings = dict(model=args.model, requests=args.requests, prompt_min=args.prompt_min,
                    prompt_max=args.prompt_max, new_tokens=args.new_tokens, budget=args.budget,
                    device=args.device, contenders=args.contenders.split(","), inductor_cache=args.inductor_cache)
    if args.smoke:
        settings.update(model="smoke", requests=6, prompt_min=16, prompt_max=200, new_tokens=8,
                        probe_lengths=[123], probe_batch=2)
    try:
        settings = ServeSettings(**settings)
    except ValueError as err:
        p.error(str(err))
    default = "/tmp/serve_smoke" if args.smoke else (
        f"docs/results/serve_{args.device}" + ("_gemma3" if args.model == "gemma3-270m" else ""))
    prefix = Path(args.out or ROOT / default)
    if args.from_json:
        prefix = Path(args.from_json).with_suffix("")
        result = json.loads(Path(args.from_json).read_text())
    else:
        result = run_serve(settings)
        result["command"], result["machine"] = command_line(), machine_description()
        write_json(prefix.with_suffix(".json"), result)
    page = serve_report(result, result["command"], result["machine"], tuple(args.targets))
    prefix.with_suffix(".md").write_text(page.replace("serve_cpu.png", prefix.name + ".png")
                                         + f"\n![cumulative wall time]({prefix.name}.png)\n")
    plot_serve(result, prefix.with_suffix(".png"))
    print(prefix.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
