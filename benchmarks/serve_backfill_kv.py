"""Per-batch H2O state bytes of a serve run that predates their recording: the same reset the run did, no
forward. Used once for docs/results/serve_cpu.json and serve_cpu_gemma3.json (their runs came before the worker
recorded these bytes):

    python benchmarks/serve_backfill_kv.py docs/results/serve_cpu.json kvbound
    python benchmarks/serve_backfill_kv.py docs/results/serve_cpu_gemma3.json gemma3-270m
    python benchmarks/serve.py --from-json docs/results/serve_cpu.json      # rewrite the markdown and plot
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import h2o_compile  # noqa: E402
from h2o_compile.bench.serve import load_model  # noqa: E402

path, name = Path(sys.argv[1]), sys.argv[2]
result = json.loads(path.read_text())
s = result["settings"]
model = load_model(name, "cpu")
opt = h2o_compile.optimize(model, budget=s["budget"], compile=False)
for r in result["results"]:
    if not r["contender"].startswith("h2o"):
        continue
    r.pop("kv_ratio_max", None)
    for b in r["batches"]:
        total = b["padded_prompt"] + s["new_tokens"]
        opt.reset(b["batch"], total)
        b["kv_bytes"], b["full_kv_bytes"] = opt.kv_cache_bytes(), opt.full_cache_bytes(b["batch"], total)
result["kv_bytes_note"] = ("kv_bytes per batch computed after the run from each batch's shape "
                           "(H2OModel.reset as in the run, no forward; benchmarks/serve_backfill_kv.py): "
                           "the run predates their recording")
path.write_text(json.dumps(result, indent=2) + "\n")
print("ok")
