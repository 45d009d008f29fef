"""Kernel tests run the Triton kernels on CPU tensors under TRITON_INTERPRET=1 when there is no GPU.

Triton reads the flag when a kernel is decorated, so it is set here, while pytest loads conftests and before
any test module imports h2o_compile.kernels.triton_*. It changes nothing for code that does not use Triton
(the reference tests, Inductor's C++ CPU backend). With CUDA the kernels are compiled for the GPU instead;
the choice is per process, so one run tests one device: CPU (interpreted) in CI, CUDA on a GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

TRITON_DEVICES = ["cuda"] if HAS_CUDA else ["cpu"]


@pytest.fixture(params=TRITON_DEVICES)
def triton_device(request) -> torch.device:
    """The device the Triton kernels run on in this process; skips when they cannot run at all."""
    pytest.importorskip("triton")
    from h2o_compile.kernels import triton_decode

    if request.param == "cpu" and not triton_decode.is_interpreted():
        pytest.skip("TRITON_INTERPRET was unset when the kernels were imported; run tests/kernels alone")
    return torch.device(request.param)


# Output tolerance by dtype: about 2x what a low-precision PyTorch attention loses against fp32 (the kernels
# round probabilities to the value dtype before P @ V). Scores are fp32 sums of fp32 probabilities.
OUT_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
SCORE_TOL = (1e-4, 1e-5)


def random_block(gen, b, hq, hkv, t, d, dtype, device):
    """q [B, Hq, T, D], k and v [B, Hkv, T, D], drawn on the CPU generator (the same data on any device)."""
    shapes = [(b, hq, t, d), (b, hkv, t, d), (b, hkv, t, d)]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


def assert_same_state(got, want):
    """Identical slots (positions, keys, values) and scores within fp32 tolerance."""
    assert torch.equal(got.pos_cache, want.pos_cache), f"slots differ:\n{got.pos_cache}\n{want.pos_cache}"
    assert torch.equal(got.key_cache, want.key_cache)
    assert torch.equal(got.value_cache, want.value_cache)
    rtol, atol = SCORE_TOL
    torch.testing.assert_close(got.score_cache, want.score_cache, rtol=rtol, atol=atol)
    assert (got.key_scale is None) == (want.key_scale is None)
    if want.key_scale is not None:  # quantized: the scales of the same vectors, computed the same way
        torch.testing.assert_close(got.key_scale, want.key_scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(got.value_scale, want.value_scale, rtol=1e-6, atol=0)


def assert_close_out(got, want):
    rtol, atol = OUT_TOL[want.dtype]
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
