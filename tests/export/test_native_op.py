"""The native custom op (export/native) == the ONNX function == kernels/reference.py, op by op.

Every case of test_onnx_function.py's run_sequence is fed through a pair of ONNX Runtime sessions on the same
one-node model: one with the custom-op library registered (ONNX Runtime then runs our kernel, see
test_registered_library_wins_over_the_function) and one without (it inlines the function). Each step
compares native against the function, and run_sequence compares the native outputs against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from onnx import TensorProto, helper

from h2o_compile.export.native import API_VERSION, NativeBuildError, api_version_of, library_path
from h2o_compile.export.onnx_function import DOMAIN, FUNCTION_NAME, H2OAttention
from ..helpers import served_rules
from tests.export.test_onnx_function import BLOCKS, NAMES, OUTS, one_node_model, run_sequence, sink_logits


@pytest.fixture(scope="module")
def lib() -> str:
    try:
        return str(library_path())
    except NativeBuildError as exc:  # no compiler on this machine: the function path still runs
        pytest.skip(str(exc))


def session(model, lib=None):
    options = ort.SessionOptions()
    if lib is not None:
        options.register_custom_ops_library(lib)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


class NativeAndFunction:
    """Looks like one session to run_sequence; runs both and checks native against the function each step."""

    def __init__(self, model, lib):
        self.native, self.function = session(model, lib), session(model)
        self.steps = 0

    def get_inputs(self):
        return self.native.get_inputs()

    def run(self, names, feed):
        got, want = self.native.run(names, feed), self.function.run(names, feed)
        np.testing.assert_array_equal(got[4], want[4], err_msg=f"positions vs function, step {self.steps}")
        for i, name in enumerate(OUTS[:4]):
            np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=1e-5, err_msg=f"{name} vs function")
        self.steps += 1
        return got


def both(lib, policy, *, recent=2, sinks=0, seed=5, window=0, softcap=0.0, rolling=0, **kw):
    rope = kw.get("rope")
    model = one_node_model(scale=0.3, recent=recent, sinks=sinks, policy=policy, seed=seed, window=window,
                           softcap=softcap, rolling=rolling, max_distance=0 if rope is None else rope.max_distance)
    pair = NativeAndFunction(model, lib)
    result = run_sequence(policy, recent=recent, sinks=sinks, seed=seed, window=window, softcap=softcap,
                          session=pair, **kw)
    assert pair.steps > 0
    return result


def test_library_reports_its_api_version(lib):
    assert api_version_of(lib) == API_VERSION == 16
    # Registering succeeded, so this runtime's OrtApiBase::GetApi(16) returned a table.
    assert tuple(int(x) for x in ort.__version__.split(".")[:2]) >= (1, 16)


def test_registered_library_wins_over_the_function(lib, tmp_path):
    """Measured: with the library registered, ONNX Runtime keeps the node and runs the registered kernel
    (a model-local function of the same domain and name is only inlined when no kernel claims the node), at
    every optimization level. So one file serves both; the choice is made at load time."""
    model = one_node_model(scale=0.3, recent=2, sinks=0, policy="h2o", seed=0)
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        for registered in (False, True):
            options = ort.SessionOptions()
            options.graph_optimization_level = level
            options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
            if registered:
                options.register_custom_ops_library(lib)
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
            assert (ops == [FUNCTION_NAME]) == registered, (level, registered, ops[:5])


def test_node_without_function_body_needs_the_library(lib):
    model = one_node_model(scale=0.3, recent=2, sinks=1, policy="h2o", seed=5)
    del model.functions[:]
    assert run_sequence("h2o", blocks=BLOCKS, sinks=1, session=session(model, lib))[0] > 0
    with pytest.raises(Exception, match="H2OAttention"):
        session(model)


@pytest.mark.parametrize("policy,sinks", [("h2o", 0), ("h2o", 1), ("local", 0), ("sink", 2), ("random", 1),
                                          ("full", 0)])
def test_policies(lib, policy, sinks):
    assert both(lib, policy, blocks=BLOCKS, sinks=sinks)[0] > 0


@pytest.mark.parametrize("rule", served_rules("native ORT CPU"))
@pytest.mark.parametrize("window", [0, 4])
def test_score_rules(lib, rule, window):
    assert both(lib, rule, blocks=BLOCKS, sinks=1, window=window)[0] > 0


@pytest.mark.parametrize("sinks_kind", [None, "random", "mixed"])
@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("window", [0, 4])
def test_attention_kinds(lib, window, softcap, sinks_kind):
    evictions, left_window = both(lib, "h2o", blocks=BLOCKS, sinks=1, window=window, softcap=softcap,
                                  sink_logits=sink_logits(sinks_kind))
    assert evictions > 0 and (left_window > 0) == (window > 0)


@pytest.mark.parametrize("policy", ["local", "random", "full"])
def test_window_with_other_policies(lib, policy):
    assert both(lib, policy, blocks=BLOCKS, window=4, softcap=2.5, sink_logits=sink_logits("random"))[1] > 0


def test_window_edges_and_long_blocks(lib):
    assert both(lib, "h2o", blocks=[9, 1, 1, 12, 1, 1, 1], cap=5, recent=2, sinks=1, window=7)[1] > 0
    assert both(lib, "h2o", blocks=[6, 1, 1, 1, 2, 1, 1], cap=6, recent=1, window=6, gap=5)[1] > 6
    assert both(lib, "h2o", blocks=[9, 1, 12, 1], cap=4, recent=1)[0] > 0  # T > C


def test_ties_random_hash_and_no_eviction(lib):
    assert both(lib, "h2o", blocks=[6, 1, 1, 1, 1, 3, 1, 1], sinks=1, tied_scores=True)[0] > 0
    assert both(lib, "h2o", blocks=[1] * 12, sinks=1, recent=1, cap=4, tied_scores=True)[0] > 0
    assert both(lib, "random", blocks=[4, 1, 1, 2, 1, 1, 1], pos_offset=1_000_000, seed=123456)[0] > 0
    assert both(lib, "h2o", blocks=[2, 1, 1], cap=8)[0] == 0


@pytest.mark.parametrize("max_distance", [0, 5], ids=["rank", "capped"])
@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("rotary", [8, 4], ids=["full-rotary", "partial-rotary"])
@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_rolling_positions(lib, policy, rotary, window, max_distance):
    from h2o_compile.kernels.rolling import RopeTables

    inv_freq = 1.0 / (30.0 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    angles = torch.arange(6 + max(BLOCKS) + 2, dtype=torch.float64)[:, None] * inv_freq[None, :]
    both_halves = torch.cat([angles, angles], dim=-1)[None]
    rope = RopeTables(both_halves.cos().float(), both_halves.sin().float(), max_distance)
    assert both(lib, policy, blocks=BLOCKS, sinks=2 if policy == "sink" else 0, window=window, rolling=1,
                rope=rope)[0] > 0


def typed_model(q_type, cache_type, *, policy=0, window=0, rolling=0, with_function=True):
    """The one-node model with q/k/v/out of ``q_type`` and the key/value caches of ``cache_type``."""
    types = [q_type] * 3 + [TensorProto.INT64, TensorProto.BOOL] + [cache_type] * 2 + [
        TensorProto.FLOAT, TensorProto.INT64] + [TensorProto.FLOAT] * 3
    ranks = [4, 4, 4, 2, 2, 4, 4, 3, 3, 1, 3, 3]
    node = helper.make_node(FUNCTION_NAME, NAMES, OUTS, domain=DOMAIN, scale=0.3, recent=2, sinks=1, policy=policy,
                            seed=3, window=window, softcap=0.0, rolling=rolling, score=0, decay=1.0)
    inputs = [helper.make_tensor_value_info(n, t, [f"{n}_{i}" for i in range(r)])
              for n, t, r in zip(NAMES, types, ranks)]
    out_types = [q_type, cache_type, cache_type, TensorProto.FLOAT, TensorProto.INT64]
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(OUTS, out_types)]
    graph = helper.make_graph([node], "h2o", inputs, outputs)
    functions = [H2OAttention.to_function_proto()] if with_function else []
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                             functions=functions)


@pytest.mark.parametrize("q16,c16", [(True, True), (False, True), (True, False)])
def test_float16_equals_function(lib, q16, c16):
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    model = typed_model(f16 if q16 else f32, f16 if c16 else f32)
    native, function = session(model, lib), session(model)
    qd, cd = (np.float16 if q16 else np.float32), (np.float16 if c16 else np.float32)
    rng = np.random.default_rng(0)
    b, hq, hkv, d, cap = 2, 4, 2, 8, 6
    state = [np.zeros((b, hkv, cap, d), cd), np.zeros((b, hkv, cap, d), cd), np.zeros((b, hkv, cap), np.float32),
             np.full((b, hkv, cap), -1, np.int64)]
    seen, evicted = 0, 0
    for step, t in enumerate([5, 1, 3, 1, 1, 1, 4, 1]):
        feed = dict(q=rng.standard_normal((b, hq, t, d)).astype(qd), k=rng.standard_normal((b, hkv, t, d)).astype(qd),
                    v=rng.standard_normal((b, hkv, t, d)).astype(qd),
                    positions=np.broadcast_to(np.arange(seen, seen + t), (b, t)).copy(),
                    valid=np.ones((b, t), bool), sink_logits=np.full(hq, -np.inf, np.float32),
                    rope_cos=np.zeros((1, 1, 2), np.float32), rope_sin=np.zeros((1, 1, 2), np.float32))
        feed.update(zip(NAMES[5:9], state))
        got, want = native.run(None, feed), function.run(None, feed)
        assert got[0].dtype == qd and got[1].dtype == cd
        np.testing.assert_array_equal(got[4], want[4], err_msg=f"positions, step {step}")
        np.testing.assert_array_equal(got[1], want[1], err_msg=f"keys, step {step}")
        np.testing.assert_array_equal(got[2], want[2], err_msg=f"values, step {step}")
        tol = 2e-3 if q16 or c16 else 1e-5
        np.testing.assert_allclose(got[0].astype(np.float32), want[0].astype(np.float32), rtol=tol, atol=tol)
        np.testing.assert_allclose(got[3], want[3], rtol=1e-4, atol=1e-5)
        evicted += int((state[3] >= 0).sum() + b * hkv * t - (got[4] >= 0).sum())
        state, seen = got[1:], seen + t
    assert evicted > 0


def test_compiler_failure_names_the_command(monkeypatch, tmp_path):
    from h2o_compile.export.native import build

    monkeypatch.setenv("H2O_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(NativeBuildError, match="no-such-compiler"):
        build.library_path()
    fake = tmp_path / "bad-cxx"
    fake.write_text("#!/bin/sh\necho 'fatal: no' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    with pytest.raises(NativeBuildError, match=r"(?s)exit 3\).*bad-cxx.*h2o_op.cc.*fatal: no"):
        build.library_path()


def test_library_is_cached_per_runtime_and_source(lib):
    from h2o_compile.export.native import build

    assert f"ort-{ort.__version__}-" in lib
    assert build.library_path() == build.library_path()  # built once


def test_one_session_options_serves_several_sessions(lib):
    """Registering the library twice on one SessionOptions makes ONNX Runtime refuse the session ("Domain
    already set in registry"); native_session.choose registers it once per options object."""
    from h2o_compile.export import native_session

    options = ort.SessionOptions()
    model = one_node_model(scale=0.3, recent=2, sinks=0, policy="h2o", seed=0).SerializeToString()
    for _ in range(2):
        options, used = native_session.choose(True, "CPUExecutionProvider", {}, options)
        assert used
        ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="native="):
        native_session.choose("yes", "CPUExecutionProvider", {}, None)


def test_abi_slots_beyond_the_cpu_library(tmp_path):
    """The CUDA library calls OrtApi slot 193 (KernelContext_GetGPUComputeStream), which no CPU test reaches:
    a probe op, run in a subprocess, calls slot 192 as HasValue (1 for a present input) and slot 193 (no
    stream on the CPU provider), both returning OK, so the count of ort_abi.h's placeholders is right."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = Path(__file__).parent / "native_probe" / "probe.cc"
    lib = tmp_path / "libprobe.so"
    subprocess.run([cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-fvisibility=hidden", "-o", str(lib), str(src)],
                   check=True)
    script = f"""
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper
node = helper.make_node("Probe", ["x"], ["y"], domain="probe")
graph = helper.make_graph([node], "p", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("probe", 1)])
o = ort.SessionOptions(); o.register_custom_ops_library({str(lib)!r})
s = ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"])
print(s.run(None, {{"x": np.ones(2, np.float32)}})[0].tolist())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[1.0, 1.0, 1.0]"
