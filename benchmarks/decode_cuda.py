"""GPU decode benchmark: CUDA graphs on/off and the largest batch under a memory cap (h2o_compile/bench/cuda.py).

    python benchmarks/decode_cuda.py --out $OUT/decode_cuda          # on a CUDA machine (gpu_check.sh runs it)
    python benchmarks/decode_cuda.py --device cpu --smoke            # the harness on tiny sizes, no GPU needed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from h2o_compile.bench.cuda import CudaBenchSettings, run_cuda_bench
from h2o_compile.bench.report import write_cuda_report
from h2o_compile.reporting import command_line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="kvbound", choices=("kvbound", "tiny", "smoke"))
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--total", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--memory-cap-gib", type=float, default=16.0)
    parser.add_argument("--parts", default="graphs,memory_cap", help="graphs,memory_cap")
    parser.add_argument("--smoke", action="store_true", help="smoke model, short lengths, fp32")
    parser.add_argument("--out", default="docs/results/decode_cuda", help="path without extension")
    args = parser.parse_args(argv)
    settings = dict(device=args.device, model=args.model, dtype=args.dtype, batch=args.batch, total=args.total,
                    budget=args.budget, memory_cap_gib=args.memory_cap_gib)
    if args.smoke:
        settings.update(model="smoke", dtype="float32", batch=2, total=64, steps=4, warmup=2, repeats=2,
                        memory_cap_gib=0.5, probe_batches=[1, 2], max_batch=8)
    command = "python benchmarks/" + command_line()

    def write(result):  # after each part: a timeout keeps what finished
        return write_cuda_report(result, args.out, command)

    result = run_cuda_bench(CudaBenchSettings(**settings), parts=tuple(args.parts.split(",")), after_part=write)
    paths = write(result)
    print(paths["markdown"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
