"""One H2OAttention decode call in ONNX Runtime: the inlined ONNX function vs the native custom op.

    python research/native_op_micro.py [--batch 1 8] [--slots 410]

A one-node model (the node of tests/export/test_onnx_function.py) with a full cache of C slots, Hq = Hkv = 8,
head dim 64 (the layer of benchmarks/onnx_decode.py at 2k context, budget 0.2), bound with IO binding so no
input is copied per call. The function writes its state to separate output buffers; the native op is timed as
H2OOrtModel runs it, past and present state bound to the same buffers (in place), and also with separate ones.
Prints microseconds per call (median and min of 300 after 20 warm-up calls), one intra-op thread.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--slots", type=int, default=410)
    args = ap.parse_args()
    import onnxruntime as ort

    from h2o_compile.export.native import library_path
    from tests.export.test_onnx_function import NAMES, OUTS, one_node_model

    hq = hkv = 8
    d, cap = 64, args.slots
    model = one_node_model(scale=0.125, recent=cap // 2, sinks=0, policy="h2o", seed=0).SerializeToString()
    for b in args.batch:
        rng = np.random.default_rng(0)
        f32 = np.float32
        feed = dict(q=rng.standard_normal((b, hq, 1, d), f32), k=rng.standard_normal((b, hkv, 1, d), f32),
                    v=rng.standard_normal((b, hkv, 1, d), f32), positions=np.full((b, 1), 5000),
                    valid=np.ones((b, 1), bool), key_cache=rng.standard_normal((b, hkv, cap, d), f32),
                    value_cache=rng.standard_normal((b, hkv, cap, d), f32), score_cache=rng.random((b, hkv, cap), f32),
                    pos_cache=np.tile(np.arange(cap), (b, hkv, 1)), sink_logits=np.full(hq, -np.inf, f32),
                    rope_cos=np.zeros((1, 1, 2), f32), rope_sin=np.zeros((1, 1, 2), f32))
        for name, native, in_place in (("function", False, False), ("native", True, False),
                                       ("native in place", True, True)):
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            if native:
                options.register_custom_ops_library(str(library_path()))
            session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
            io = session.io_binding()
            values = {n: ort.OrtValue.ortvalue_from_numpy(feed[n].copy()) for n in NAMES}
            for n in NAMES:
                io.bind_ortvalue_input(n, values[n])
            state = [values[n] if in_place else ort.OrtValue.ortvalue_from_numpy(feed[n].copy()) for n in NAMES[5:9]]
            for n, v in zip(OUTS, [ort.OrtValue.ortvalue_from_numpy(np.empty((b, hq, 1, d), f32))] + state):
                io.bind_ortvalue_output(n, v)
            for _ in range(20):
                session.run_with_iobinding(io)
            times = []
            for _ in range(300):
                start = time.perf_counter()
                session.run_with_iobinding(io)
                times.append(time.perf_counter() - start)
            print(f"batch {b}, C {cap}: {name:16s} median {np.median(times) * 1e6:8.1f} us, "
                  f"min {min(times) * 1e6:8.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
