"""The native H2OAttention op on ONNX Runtime's CUDA provider (run by benchmarks/gpu_check.sh, STAGES=native).

    python benchmarks/native_cuda_check.py --out out/native_cuda

1. Builds h2o_op_cuda.cu with nvcc (sm_90) into the cache and registers it (onnxruntime-gpu).
2. Op level: the one-node model of tests/export/test_onnx_function.py on the CUDA provider with the library,
   step by step against kernels/reference.py (policies, window, soft-cap, sinks, rolling, T > C).
3. Whole model: a random Llama exported once, greedy tokens of native vs function on CUDA equal, and decode
   tokens/s of both at ``--context`` tokens, batch 1 and 8.
Writes ``<out>.json``; exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch


def op_level(lib: str) -> list[str]:
    import onnxruntime as ort

    from h2o_compile.kernels.rolling import RopeTables
    from tests.export.test_onnx_function import BLOCKS, one_node_model, run_sequence, sink_logits

    angles = torch.arange(32, dtype=torch.float64)[:, None] * (1.0 / 30.0 ** (torch.arange(0, 8, 2) / 8))[None]
    both = torch.cat([angles, angles], -1)[None]
    rope = RopeTables(both.cos().float(), both.sin().float())
    cases = {"h2o": dict(policy="h2o", sinks=1), "local": dict(policy="local"), "random": dict(policy="random"),
             "mean_window": dict(policy="h2o;score=mean", sinks=1, window=4),
             "decay": dict(policy="h2o;decay=0.5", sinks=1), "softcap_sinks": dict(policy="h2o", softcap=2.5,
                                                                                  sink_logits=sink_logits("mixed")),
             "rolling": dict(policy="h2o", rope=rope), "long_block": dict(policy="h2o", blocks=[9, 1, 12, 1], cap=4,
                                                                          recent=1)}
    done = []
    for name, kw in cases.items():
        kw = dict(kw)
        blocks = kw.pop("blocks", BLOCKS)
        model = one_node_model(scale=0.3, recent=kw.get("recent", 2), sinks=kw.get("sinks", 0),
                               policy=kw["policy"], seed=5, window=kw.get("window", 0),
                               softcap=kw.get("softcap", 0.0), rolling=int("rope" in kw))
        options = ort.SessionOptions()
        options.register_custom_ops_library(lib)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])
        policy = kw.pop("policy")
        run_sequence(policy, blocks=blocks, session=session, **kw)
        done.append(name)
        print(f"op level {name}: equal to the reference", flush=True)
    return done


def decode_rate(model, batch: int, context: int, steps: int = 24, warmup: int = 6) -> float:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (batch, context - steps), generator=gen)
    model.reset(batch, context)
    token = model.step(prompt)[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token = model.step(token)[:, -1].argmax(-1, keepdim=True)
        if token.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return batch / statistics.median(times[warmup:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/native_cuda")
    ap.add_argument("--context", type=int, default=2048)
    args = ap.parse_args()
    import transformers

    from h2o_compile.export.native.build import cuda_library_path
    from h2o_compile.export.onnx import export_onnx
    from h2o_compile.export.ort import H2OOrtModel

    result = {"library": str(cuda_library_path())}
    result["op_level"] = op_level(result["library"])
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=args.context)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        out = export_onnx(model, Path(tmp) / "h2o", budget=0.2, max_seq_len=args.context, prefill=256)
        native = H2OOrtModel.from_pretrained(out, provider="cuda", native=True)
        function = H2OOrtModel.from_pretrained(out, provider="cuda", native=False)
        ids = torch.randint(0, 8192, (2, 40), generator=torch.Generator().manual_seed(1))
        same = torch.equal(native.generate(ids, max_new_tokens=64).cpu(),
                           function.generate(ids, max_new_tokens=64).cpu())
        result["greedy_tokens_equal"] = same
        result["decode_tokens_per_s"] = {f"{name}_batch{b}": round(decode_rate(m, b, args.context), 2)
                                         for b in (1, 8) for name, m in (("function", function), ("native", native))}
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
