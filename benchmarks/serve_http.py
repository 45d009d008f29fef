"""HTTP load benchmark: ``h2o-compile serve`` against ``transformers serve --continuous-batching`` under a seeded
Poisson stream of requests over 127.0.0.1 (what is measured: h2o_compile/bench/serve_http.py).

    python benchmarks/serve_http.py --model tiny --out docs/results/serve_http/tiny
    python benchmarks/serve_http.py --model gemma3-270m --api chat --rate 0.5 --out docs/results/serve_http/gemma3
    python benchmarks/serve_http.py --smoke                       # 6 requests, output under /tmp
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from h2o_compile.bench.serve_http import (SERVERS, HttpLoadSettings, http_load_report,  # noqa: E402
                                          plot_http_load, run_http_load)
from h2o_compile.reporting import command_line, machine_description, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(HttpLoadSettings):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--smoke", action="store_true", help="6 short requests, output under /tmp")
    p.add_argument("--out", default=None, help="output prefix (.json / .md / .png)")
    args = p.parse_args(argv)
    settings = HttpLoadSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(HttpLoadSettings)})
    if args.smoke:
        settings = dataclasses.replace(settings, requests=6, prompt_max=120, new_max=16, rate=4.0)
    prefix = Path(args.out or ("/tmp/serve_http_smoke" if args.smoke else f"runs/serve_http_{args.model}"))
    if prefix.with_suffix(".json").exists():
        p.error(f"{prefix.with_suffix('.json')} exists; give another --out (results are never overwritten)")
    result = run_http_load(settings, servers=args.servers.split(","))
    result["command"], result["machine"] = command_line(), machine_description()
    write_json(prefix.with_suffix(".json"), result)
    prefix.with_suffix(".md").write_text(http_load_report(result, result["command"], result["machine"])
                                         + f"\n![server memory]({prefix.name}.png)\n")
    plot_http_load(result, prefix.with_suffix(".png"))
    print(prefix.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
