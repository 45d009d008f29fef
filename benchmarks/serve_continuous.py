"""Continuous batching benchmark: a seeded stream of requests arriving over time, served by H2O continuous
batching, H2O fixed groups, transformers' continuous batching (paged attention) and transformers' generate in
fixed groups. What is measured: h2o_compile/bench/serve_continuous.py.

    python benchmarks/serve_continuous.py                        # KV-bound model -> docs/results/serve_continuous_cpu.*
    python benchmarks/serve_continuous.py --model gemma3-270m    # -> docs/results/serve_continuous_cpu_gemma3.*
    python benchmarks/serve_continuous.py --smoke                # small sizes, output under /tmp
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from h2o_compile.bench.serve_continuous import (CONTENDERS, ContinuousSettings,  # noqa: E402
                                                continuous_report, plot_continuous, run_continuous)
from h2o_compile.reporting import command_line, machine_description, write_json  # noqa: E402


def main(argv=None) -> int:
    defaults = ContinuousSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kvbound", help="kvbound or smoke (random Llamas), tiny, gemma3-270m, "
                   "or a local model folder / .gguf file")
    for name in ("requests", "prompt_min", "prompt_max", "new_min", "new_max", "rows", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    p.add_argument("--rate", type=float, default=defaults.rate, help="arrivals per second")
    p.add_argument("--budget", type=float, default=defaults.budget)
    p.add_argument("--no-compile", action="store_true", help="the H2O contenders eager")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--smoke", action="store_true", help="smoke model, 6 short requests, output under /tmp")
    p.add_argument("--out", help="output prefix (default docs/results/serve_continuous_cpu[_MODEL])")
    p.add_argument("--from-json", help="only rewrite the markdown and plot of an earlier run's JSON")
    args = p.parse_args(argv)
    settings = {name: getattr(args, name) for name in ("model", "requests", "prompt_min", "prompt_max", "new_min",
                                                       "new_max", "rows", "seed", "rate", "budget")}
    settings.update(compile=not args.no_compile, contenders=args.contenders.split(","))
    if args.smoke:
        settings.update(model="smoke", requests=6, prompt_min=16, prompt_max=120, new_min=4, new_max=24, rows=3)
    try:
        settings = ContinuousSettings(**settings)
    except ValueError as err:
        p.error(str(err))
    suffix = {"kvbound": "", "gemma3-270m": "_gemma3"}.get(args.model, "_" + Path(args.model).stem)
    default = "/tmp/serve_continuous_smoke" if args.smoke else "docs/results/serve_continuous_cpu" + suffix
    prefix = Path(args.out or ROOT / default)
    if args.from_json:
        prefix = Path(args.from_json).with_suffix("")
        result = json.loads(Path(args.from_json).read_text())
    else:
        if prefix.with_suffix(".json").exists():
            p.error(f"{prefix.with_suffix('.json')} exists; give another --out (results are never overwritten)")
        result = run_continuous(settings)
        result["command"], result["machine"] = command_line(), machine_description()
        write_json(prefix.with_suffix(".json"), result)
    prefix.with_suffix(".md").write_text(continuous_report(result, result["command"], result["machine"])
                                         + f"\n![latency distribution]({prefix.name}.png)\n")
    plot_continuous(result, prefix.with_suffix(".png"))
    print(prefix.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
