#!/usr/bin/env bash
# The GPU checks of the Triton kernels, as one run on a machine with a CUDA GPU:
#   1. tests/kernels on CUDA (compiled kernels, larger shapes, bf16, CUDA-graph replay, torch.compile);
#   2. benchmarks/decode_kernel_micro.py (fused decode vs reference vs SDPA over C slots / the full cache);
#   3. benchmarks/decode_cuda.py (whole model: CUDA graphs on/off, largest batch under a memory cap);
#   4. benchmarks/serve.py on CUDA (the CPU serving stream: H2O's compiled step with CUDA graphs, one graph for
#      every request; transformers' generate with DynamicCache and StaticCache + compile).
#   5. (STAGES=native) benchmarks/native_cuda_check.py: the native H2OAttention op built with nvcc for sm_90 and
#      run in onnxruntime-gpu: op level against the reference, native vs function tokens and decode tokens/s.
#   6. (STAGES=tp) benchmarks/tp_decode.py over NCCL: one process without tp, the tensor-parallel path over a
#      one-rank NCCL group (the functional all-reduces inside the compiled, CUDA-graph step), and two ranks
#      when the machine has two GPUs; per-rank state bytes, step time, tokens/s, same tokens -> tp_cuda.{json,md}.
# It installs nothing from the network: it uses the machine's python (with torch + triton) and imports
# h2o_compile from this checkout through PYTHONPATH. Everything lands under $OUT (default ./out):
# env.txt, pytest.log, pytest.xml, bench.log, decode_kernel_micro.json, decode_cuda.{json,md,png}, decode_cuda.log,
# serve_cuda.{json,md,png}, serve.log, tp_cuda.{json,md}, tp.log.
#
#   bash benchmarks/gpu_check.sh               # PYTHON=... to pick the interpreter, TEST_TIMEOUT=... seconds
#   STAGES="decode" bash benchmarks/gpu_check.sh   # a subset of: tests micro decode serve native tp (default all)
#
# On a lent machine with a 10-minute command limit and ~15 minutes of device time, run two commands:
#   STAGES="decode" (the whole-model benchmark, DECODE_TIMEOUT=420 s, mostly compiling) and then
#   STAGES="tests micro" (TEST_TIMEOUT=240 s + MICRO_TIMEOUT=120 s). decode_cuda.* is rewritten after each
# of its two parts, so a timeout keeps the part that finished.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET H2O_COMPILE_BACKEND  # compiled kernels; the op chooses Triton for CUDA tensors itself

{ "$PY" -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], "torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__, "cuda", torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 || true
} | tee "$OUT/env.txt"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible; nothing to check" >&2
  exit 2
fi

STAGES="${STAGES:-tests micro decode serve native tp}"
tests=0 bench=0 decode=0 serve=0
if [[ " $STAGES " == *" tests "* ]]; then
  # Kernel compilation dominates the test time: spread it over processes when pytest-xdist is there.
  XDIST=()
  if "$PY" -c 'import xdist' 2>/dev/null; then XDIST=(-n 4); fi
  timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest tests/kernels -q -p no:cacheprovider -rs --durations=15 \
    "${XDIST[@]}" --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"
  tests=${PIPESTATUS[0]}
fi
if [[ " $STAGES " == *" micro "* ]]; then
  timeout "${MICRO_TIMEOUT:-120}" "$PY" benchmarks/decode_kernel_micro.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
  bench=${PIPESTATUS[0]}
fi
if [[ " $STAGES " == *" decode "* ]]; then
  timeout "${DECODE_TIMEOUT:-420}" "$PY" benchmarks/decode_cuda.py --out "$OUT/decode_cuda" 2>&1 \
    | tee "$OUT/decode_cuda.log"
  decode=${PIPESTATUS[0]}
fi

if [[ " $STAGES " == *" serve "* ]]; then
  timeout "${SERVE_TIMEOUT:-300}" "$PY" benchmarks/serve.py --device cuda --out "$OUT/serve_cuda" 2>&1 \
    | tee "$OUT/serve.log"
  serve=${PIPESTATUS[0]}
fi

native=0
if [[ " $STAGES " == *" native "* ]]; then
  timeout "${NATIVE_TIMEOUT:-300}" "$PY" benchmarks/native_cuda_check.py --out "$OUT/native_cuda" 2>&1 \
    | tee "$OUT/native_cuda.log"
  native=${PIPESTATUS[0]}
fi

tp=0
if [[ " $STAGES " == *" tp "* ]]; then
  TP_CONFIGS="1x1,1x1tp"
  if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then TP_CONFIGS="$TP_CONFIGS,2x1"; fi
  timeout "${TP_TIMEOUT:-300}" "$PY" benchmarks/tp_decode.py --device cuda --compile --configs "$TP_CONFIGS" \
    --out "$OUT/tp_cuda" 2>&1 | tee "$OUT/tp.log"
  tp=${PIPESTATUS[0]}
fi

echo "gpu_check: native op exit $native, tensor-parallel exit $tp"
echo "gpu_check: pytest exit $tests, kernel benchmark exit $bench, decode benchmark exit $decode," \
  "serve benchmark exit $serve (results in $OUT)"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$decode" -eq 0 ] && [ "$serve" -eq 0 ] && [ "$native" -eq 0 ] \
  && [ "$tp" -eq 0 ]
