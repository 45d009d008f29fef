"""Wrong shapes, dtypes and lengths fed through ONNX Runtime into the native op: each must come back as an
ONNX Runtime error that names the input (never a crash, never a read out of bounds), and the session must
keep working afterwards."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper

from h2o_compile.export.native import NativeBuildError, library_path
from h2o_compile.export.onnx_function import DOMAIN, FUNCTION_NAME

NAMES = ["q", "k", "v", "positions", "valid", "key_cache", "value_cache", "score_cache", "pos_cache",
         "sink_logits", "rope_cos", "rope_sin"]
OUTS = ["out", "new_key", "new_value", "new_score", "new_position"]
NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
              np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
              np.dtype(np.bool_): TensorProto.BOOL, np.dtype(np.float64): TensorProto.DOUBLE}
B, HQ, HKV, T, D, C = 2, 4, 2, 3, 8, 6


@pytest.fixture(scope="module")
def lib() -> str:
    try:
        return str(library_path())
    except NativeBuildError as exc:
        pytest.skip(str(exc))


def good_feed(rolling=False):
    rng = np.random.default_rng(0)
    f = np.float32
    feed = dict(q=rng.standard_normal((B, HQ, T, D)).astype(f), k=rng.standard_normal((B, HKV, T, D)).astype(f),
                v=rng.standard_normal((B, HKV, T, D)).astype(f), positions=np.tile(np.arange(T), (B, 1)),
                valid=np.ones((B, T), bool), key_cache=np.zeros((B, HKV, C, D), f),
                value_cache=np.zeros((B, HKV, C, D), f), score_cache=np.zeros((B, HKV, C), f),
                pos_cache=np.full((B, HKV, C), -1, np.int64), sink_logits=np.full(HQ, -np.inf, f),
                rope_cos=np.ones((1, C + T, D), f) if rolling else np.zeros((1, 1, 2), f))
    feed["rope_sin"] = np.zeros_like(feed["rope_cos"])
    return feed


def native_session(lib, feed, rolling=0, **attrs):
    """A one-node model (no function body: only the native kernel can run it) declaring each input with the
    dtype and rank of ``feed`` and dynamic dims, so ONNX Runtime itself lets the bad value through."""
    attributes = dict(scale=0.3, recent=2, sinks=1, policy=0, seed=0, window=0, softcap=0.0, rolling=rolling,
                      score=0, decay=1.0)
    attributes.update(attrs)
    attributes = {k: v for k, v in attributes.items() if v is not None}
    node = helper.make_node(FUNCTION_NAME, NAMES, OUTS, domain=DOMAIN, **attributes)
    inputs = [helper.make_tensor_value_info(n, NP_TO_ONNX[feed[n].dtype], [f"{n}_{i}" for i in range(feed[n].ndim)])
              for n in NAMES]
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(OUTS, [
        NP_TO_ONNX[feed["q"].dtype], NP_TO_ONNX[feed["key_cache"].dtype], NP_TO_ONNX[feed["key_cache"].dtype],
        TensorProto.FLOAT, TensorProto.INT64])]
    model = helper.make_model(helper.make_graph([node], "h2o", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(lib)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])



BAD_INPUTS = [
    ("q", "rank 3", lambda f: f["q"][:, :, 0]),
    ("k", "T differs from q", lambda f: np.concatenate([f["k"], f["k"][:, :, :1]], axis=2)),
    ("k", "KV heads do not divide the query heads", lambda f: np.concatenate([f["k"], f["k"][:, :1]], axis=1)),
    ("k", "head dim differs", lambda f: f["k"][..., :4].copy()),
    ("k", "dtype float16 with q float32", lambda f: f["k"].astype(np.float16)),
    ("v", "batch differs", lambda f: f["v"][:1].copy()),
    ("positions", "int32", lambda f: f["positions"].astype(np.int32)),
    ("positions", "length T + 1", lambda f: np.tile(np.arange(T + 1), (B, 1))),
    ("valid", "int64 instead of bool", lambda f: f["valid"].astype(np.int64)),
    ("valid", "length T - 1", lambda f: f["valid"][:, :-1].copy()),
    ("value_cache", "C - 1 slots", lambda f: f["value_cache"][:, :, :-1].copy()),
    ("value_cache", "float16 next to a float32 key cache", lambda f: f["value_cache"].astype(np.float16)),
    ("score_cache", "float16", lambda f: f["score_cache"].astype(np.float16)),
    ("score_cache", "C + 1 slots", lambda f: np.zeros((B, HKV, C + 1), np.float32)),
    ("pos_cache", "int32", lambda f: f["pos_cache"].astype(np.int32)),
    ("pos_cache", "rank 2", lambda f: f["pos_cache"][:, 0].copy()),
    ("sink_logits", "length Hq + 1", lambda f: np.full(HQ + 1, -np.inf, np.float32)),
    ("sink_logits", "float64", lambda f: f["sink_logits"].astype(np.float64)),
    ("rope_cos", "int64 placeholder", lambda f: np.zeros((1, 1, 2), np.int64)),
]


@pytest.mark.parametrize("name,why,make", BAD_INPUTS, ids=[f"{n}-{w}" for n, w, _ in BAD_INPUTS])
def test_bad_input_is_an_error_naming_it(lib, name, why, make):
    feed = good_feed()
    feed[name] = make(feed)
    sess = native_session(lib, feed)
    with pytest.raises(Exception, match=rf"H2OAttention.*'{name}'|'{name}'.*H2OAttention") as info:
        sess.run(None, feed)
    assert "must" in str(info.value) or "divide" in str(info.value)
    # The same session still runs a good feed of the same declared dtypes and ranks when one exists.
    good = good_feed()
    if all(good[n].dtype == feed[n].dtype and good[n].ndim == feed[n].ndim for n in NAMES):
        assert sess.run(None, good)[4].shape == (B, HKV, C)


@pytest.mark.parametrize("table", ["short", "odd width", "wide", "batch 3", "sin differs"])
def test_bad_rotary_tables(lib, table):
    feed = good_feed(rolling=True)
    if table == "short":
        feed["rope_cos"] = feed["rope_sin"] = np.ones((1, C + T - 1, D), np.float32)
    elif table == "odd width":
        feed["rope_cos"] = feed["rope_sin"] = np.ones((1, C + T, 3), np.float32)
    elif table == "wide":
        feed["rope_cos"] = feed["rope_sin"] = np.ones((1, C + T, D + 2), np.float32)
    elif table == "batch 3":
        feed["rope_cos"] = feed["rope_sin"] = np.ones((3, C + T, D), np.float32)
    else:
        feed["rope_sin"] = np.ones((1, C + T + 1, D), np.float32)
    name = "rope_sin" if table == "sin differs" else "rope_cos"
    with pytest.raises(Exception, match=f"'{name}'"):
        native_session(lib, feed, rolling=1).run(None, feed)
    assert native_session(lib, good_feed(True), rolling=1).run(None, good_feed(True))[4].shape == (B, HKV, C)


def test_empty_block_is_an_error(lib):
    feed = good_feed()
    for name in ("q", "k", "v"):
        feed[name] = feed[name][:, :, :0].copy()
    feed["positions"], feed["valid"] = feed["positions"][:, :0].copy(), feed["valid"][:, :0].copy()
    with pytest.raises(Exception, match="T >= 1"):
        native_session(lib, feed).run(None, feed)


@pytest.mark.parametrize("attrs,named", [({"policy": 7}, "policy"), ({"score": 3}, "score"),
                                         ({"decay": 1.5}, "decay"), ({"window": None}, "window")])
def test_bad_attribute_is_an_error(lib, attrs, named):
    feed = good_feed()
    with pytest.raises(Exception, match=named):
        native_session(lib, feed, **attrs).run(None, feed)


def test_wrongly_typed_q_has_no_kernel(lib):
    # q and key_cache select the kernel (their dtype fixes the outputs'): an int q matches none, at load time.
    feed = good_feed()
    feed["q"] = feed["q"].astype(np.int32)
    with pytest.raises(Exception, match="H2OAttention"):
        native_session(lib, feed).run(None, feed)
