"""CPU decode benchmark: H2OModel (compiled) vs transformers' DynamicCache (eager) and StaticCache +
torch.compile, with a memory-bandwidth roofline. A thin wrapper over ``h2o-compile bench``.

    python benchmarks/decode.py                  # the full run -> docs/results/decode_cpu.{json,md,png}
    python benchmarks/decode.py --smoke          # tiny sizes, seconds to a minute, output under /tmp
    python benchmarks/decode.py --models kvbound --batches 8 --totals 4096 --profile

All options: ``python benchmarks/decode.py --help``; what is measured: h2o_compile/bench/decode.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from h2o_compile.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
