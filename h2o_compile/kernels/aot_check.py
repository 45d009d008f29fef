"""Compile the Triton kernels for a real GPU target without a GPU (Triton ships ptxas), to catch what the
interpreter cannot: type errors in lowering, unsupported ops, shared-memory overflows.

    python -m h2o_compile.kernels.aot_check            # every dtype x head shape x kind (90 variants)
    python -m h2o_compile.kernels.aot_check --quick    # fp16, one head shape, every kind (10 variants)

Each dtype x head shape also compiles the four kernels once with every attention kind on (sliding window,
soft-capping, sink logits: the code paths a hybrid layer such as Gemma 2/3's or GPT-OSS's takes), and the two
decode kernels once over an int8 cache with its scales (kv_dtype="int8").

Must run with TRITON_INTERPRET unset (interpreted kernels cannot be compiled); exits 1 if any variant fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import triton_decode as td
from . import triton_prefill as tp

_FLOAT_ARGS = ("qk_scale", "scale")
_PLAIN = dict(WINDOW=0, SOFTCAP=0.0)
# A Gemma-2-like hybrid layer: window 4096, cap 50 (in the kernels' base-2 units), and sink logits.
_HYBRID = dict(WINDOW=4096, SOFTCAP=50.0 * td.LOG2E)


def _signature(fn, pointers: dict, constexprs: dict) -> dict:
    """Triton signature: pointers as given, constexprs marked, fp32 scales, every other scalar i32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    return sig


def compile_for(fn, pointers: dict, constexprs: dict, *, arch: int = 90, num_warps: int = 4):
    """One kernel variant compiled to cubin for sm_``arch``; returns the compiled kernel."""
    src = ASTSource(fn, _signature(fn, pointers, constexprs), constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))


def variants(quick: bool):
    """(name, kernel, pointer types, constexprs, num_warps) of every variant the runtime can launch."""
    dtypes = [("fp16", "tf32")] if quick else [("fp16", "tf32"), ("bf16", "tf32"), ("fp32", "ieee")]
    shapes = [(4, 128)] if quick else [(4, 128), (1, 64), (8, 80)]  # (query heads per KV head, head dim)
    for dt, precision in dtypes:
        block = 32 if dt == "fp32" else 64  # the wrappers' tiles: fp32 halved to bound shared memory
        for group, d in shapes:
            block_d = triton.next_power_of_2(d)
            common = dict(HKV=8, G=group, D=d, DV=d, BLOCK_D=block_d, BLOCK_DV=block_d, HAS_VALID=True)
            ptrs = {n: f"*{dt}" for n in ("Q", "K_CACHE", "V_CACHE", "K_NEW", "V_NEW", "OUT")}
            ptrs.update(POS_CACHE="*i64", POSITIONS="*i64", VALID="*i1", LOGITS="*fp32", PART_M="*fp32",
                        PART_L="*fp32", PART_ACC="*fp32", MASS="*fp32", MASS_NEW="*fp32",
                        SINK_LOGITS=f"*{dt}", K_SCALE="*fp32", V_SCALE="*fp32")
            int8 = dict(ptrs, K_CACHE="*i8", V_CACHE="*i8")
            plain_cache, int8_cache = dict(QUANT_K=False, QUANT_V=False), dict(QUANT_K=True, QUANT_V=True)
            partial = dict(common, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block,
                           DOT_PRECISION=precision)
            finish = dict(common, BLOCK_G=triton.next_power_of_2(group), BLOCK_N=1024)
            pre = {n: f"*{dt}" for n in ("Q", "KEYS", "VALUES", "OUT", "SINK_LOGITS")}
            pre.update(KPOS="*i64", POSITIONS="*i64", VALID="*i1", LSE="*fp32", MASS="*fp32")
            base = dict(G=group, D=d, BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d, HAS_VALID=True,
                        DOT_PRECISION=precision)
            forward = dict(base, HQ=8 * group, DV=d, BLOCK_DV=block_d)
            warps = 8 if d >= 128 else 4
            for kind, extra, sinks in (("", _PLAIN, False), (" hybrid", _HYBRID, True)):
                tag = f"{dt} G={group} D={d}{kind}"
                yield (f"decode partial {tag}", td._decode_partial_kernel, ptrs,
                       dict(partial, **extra, **plain_cache), 4)
                # The policy is torch code after the kernels (kernels/rules.py): one finish kernel per kind.
                yield (f"decode finish {tag}", td._decode_finish_kernel, ptrs,
                       dict(finish, HAS_SINKS=sinks, **extra, **plain_cache), 8)
                yield (f"prefill forward {tag}", tp._prefill_fwd_kernel, pre,
                       dict(forward, HAS_SINKS=sinks, **extra), warps)
                yield (f"prefill mass {tag}", tp._prefill_mass_kernel, pre, dict(base, HKV=8, PEAK=False, **extra),
                       warps)
            # score="max" takes each key's column maximum instead of the sum: its own mass kernel.
            tag = f"{dt} G={group} D={d} peak"
            yield f"prefill mass {tag}", tp._prefill_mass_kernel, pre, dict(base, HKV=8, PEAK=True, **_PLAIN), warps
            # Quantized entries change only the decode kernels (a block reads a dequantized copy).
            tag = f"{dt} G={group} D={d} int8"
            yield (f"decode partial {tag}", td._decode_partial_kernel, int8, dict(partial, **_PLAIN, **int8_cache), 4)
            yield (f"decode finish {tag}", td._decode_finish_kernel, int8,
                   dict(finish, HAS_SINKS=False, **_PLAIN, **int8_cache), 8)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90 = H100/H200)")
    args = parser.parse_args(argv)
    if td.is_interpreted():
        print("aot_check: TRITON_INTERPRET is set; unset it to compile the kernels", file=sys.stderr)
        return 2
    failed = 0
    for name, fn, pointers, constexprs, warps in variants(args.quick):
        start = time.perf_counter()
        try:
            kernel = compile_for(fn, pointers, constexprs, arch=args.arch, num_warps=warps)
        except Exception as err:  # report every failing variant, not just the first
            failed += 1
            print(f"FAIL {name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            continue
        print(f"ok   {name} ({time.perf_counter() - start:.1f} s, shared memory {kernel.metadata.shared} B)")
    print(f"aot_check: {failed} of the variants failed" if failed else "aot_check: every variant compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
