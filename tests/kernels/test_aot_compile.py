"""The Triton kernels compile for a real GPU (sm_90) without one: Triton's bundled ptxas catches the lowering
errors the interpreter never sees. A subprocess, because this process imported the kernels interpreted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cold cache: every variant really compiles
    run = subprocess.run([sys.executable, "-m", "h2o_compile.kernels.aot_check", "--quick"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    compiled = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    # decode partial, finish, prefill forward and mass (the policy is torch code after them); then the hybrid
    # kind (window, soft-cap, sink logits) of the same four; the mass kernel of score="max"; the two decode
    # kernels over an int8 cache
    assert len(compiled) == 11, run.stdout
    assert sum(" peak " in line for line in compiled) == 1, run.stdout
    assert sum(" hybrid " in line for line in compiled) == 4, run.stdout
    assert sum(" int8 " in line for line in compiled) == 2, run.stdout
