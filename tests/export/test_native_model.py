"""Whole models through the native op: export_onnx(op=...) + H2OOrtModel(native=...) against H2OModel.

Llama (GQA), the hybrid Gemma 3 (sliding-window layers next to global ones), Gemma 2 (soft-capping, its
sliding layers compressed), rolling positions and a chunked prefill, fp32 and fp16: logits, kept positions
of every layer and greedy tokens must agree with the PyTorch runtime while the cache evicts, and the native
and function paths of one file must give the same tokens."""

from __future__ import annotations

import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import h2o_compile
from h2o_compile.export.native import NativeBuildError, library_path
from h2o_compile.export.onnx import export_onnx
from h2o_compile.export.ort import H2OOrtModel

from ..runtime.arch_configs import build
from .test_onnx_export import MAX_SEQ_LEN, drive_both, prompts

CASES = {  # name -> (architecture, export op, settings)
    "llama_h2o": ("llama", "function", {"budget": 6, "sink_tokens": 1, "policy": "h2o"}),
    "gemma3_window_cache": ("gemma3", "native", {"budget": 8, "sink_tokens": 1, "policy": "h2o", "prefill": 4}),
    "gemma2_compressed": ("gemma2", "native", {"budget": 8, "policy": "h2o", "compress_sliding": True}),
    "gemma2_global_share": ("gemma2", "native", {"budget": 8, "policy": "h2o", "compress_sliding": True,
                                                 "global_share": 1.5}),
    "llama_calibrated_split": ("llama", "native", {"budget": 6, "sink_tokens": 1, "allocation": (0.5, 1.5)}),
    "llama_head_split": ("llama", "native", {"budget": 6, "sink_tokens": 1, "allocation": ((0.5, 1.5), (1.25, 0.75))}),
    "llama_rolling_mean": ("llama", "native", {"budget": 6, "sink_tokens": 1, "score": "mean",
                                               "positions": "rolling"}),
    "llama_decayed_peak": ("llama", "native", {"budget": 6, "sink_tokens": 1, "score": "max", "decay": 0.8}),
    "gemma2_score_per_kind": ("gemma2", "native", {"budget": 8, "policy": "h2o", "compress_sliding": True,
                                                   "score": "sum", "sliding_score": "max", "decay": 0.8}),
    "gemma3_capped_chunked": ("gemma3", "native", {"budget": 8, "policy": "h2o", "compress_sliding": True,
                                                   "positions": "capped", "max_distance": 12, "prefill": 4}),
    # int8 entries: the node sees dequantized caches, so the state is not updated in place.
    "llama_int8": ("llama", "native", {"budget": 6, "sink_tokens": 1, "kv_dtype": "int8"}),
}


@pytest.fixture(scope="module", autouse=True)
def lib():
    try:
        return library_path()
    except NativeBuildError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("name", list(CASES))
def test_native_matches_h2o_model(tmp_path, name):
    arch, op, settings = CASES[name]
    model = build(arch, seed=1)
    out = export_onnx(model, tmp_path / name, max_seq_len=MAX_SEQ_LEN, op=op, **settings)
    ours = H2OOrtModel.from_pretrained(out, provider="cpu", native=True)
    # One state buffer set, written in place by the kernel (not with int8 entries: they go through Cast ops).
    assert ours.native and ours._in_place == ("kv_dtype" not in settings)
    theirs = h2o_compile.optimize(model, compile=False, **settings)
    ids, mask = prompts()
    worst, evicting = drive_both(ours, theirs, ids, mask, steps=24, max_seq_len=MAX_SEQ_LEN)
    assert worst < 1e-4, f"max logit difference {worst}"
    assert evicting >= 12
    want = theirs.generate(ids, attention_mask=mask, max_new_tokens=MAX_SEQ_LEN - ids.shape[1])
    assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=MAX_SEQ_LEN - ids.shape[1]), want)
    if op == "function":  # the same file without the library: the inlined function, the same tokens
        plain = H2OOrtModel.from_pretrained(out, provider="cpu", native=False)
        assert not plain.native and not plain._in_place
        assert torch.equal(plain.generate(ids, attention_mask=mask, max_new_tokens=MAX_SEQ_LEN - ids.shape[1]),
                           want)
    else:
        with pytest.raises(ValueError, match="op='native'"):
            H2OOrtModel.from_pretrained(out, provider="cpu", native=False)


def test_float16_native_equals_function_and_h2o_model(tmp_path):
    model = build("llama", seed=1, dtype=torch.float16)
    settings = {"budget": 6, "sink_tokens": 1, "policy": "h2o"}
    out = export_onnx(model, tmp_path / "fp16", max_seq_len=MAX_SEQ_LEN, **settings)
    native = H2OOrtModel.from_pretrained(out, provider="cpu", native=True)
    function = H2OOrtModel.from_pretrained(out, provider="cpu", native=False)
    ids, mask = prompts()
    new = MAX_SEQ_LEN - ids.shape[1]
    got = native.generate(ids, attention_mask=mask, max_new_tokens=new, output_logits=True,
                          return_dict_in_generate=True)
    want = function.generate(ids, attention_mask=mask, max_new_tokens=new, output_logits=True,
                             return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(got.logits, want.logits))
    assert worst < 2e-2, f"fp16 logits differ by {worst}"
    theirs = h2o_compile.optimize(model, compile=False, **settings)
    assert torch.equal(got.sequences, theirs.generate(ids, attention_mask=mask, max_new_tokens=new))
    for layer in range(theirs.limits.num_layers):
        assert torch.equal(native.kept_positions(layer), theirs.kept_positions(layer))


def test_an_unknown_op_is_named():
    from h2o_compile.config import H2OConfig
    from h2o_compile.export.onnx import _check_op

    with pytest.raises(ValueError, match="op='wasm'; allowed: 'function', 'native'"):
        _check_op("wasm", H2OConfig())


def test_cli_export_op_native_then_generate_native(model_dir, tmp_path, capsys):
    from h2o_compile.cli import main

    out = tmp_path / "native"
    assert main(["export", "--model", str(model_dir), "-o", str(out), "--budget", "8", "--max-seq-len", "20",
                 "--op", "native"]) == 0
    capsys.readouterr()
    prompt = "w3 w9 w27 w81 w50 w12 w1 w8 w64 w30"
    assert main(["generate", "--model", str(out), "--backend", "onnx", "--native", "--prompt", prompt,
                 "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert "native op" in printed
    assert main(["generate", "--model", str(model_dir), "--budget", "8", "--prompt", prompt, "--max-new-tokens", "8",
                 "--compile", "off"]) == 0
    assert printed.split("\n")[0] == capsys.readouterr().out.split("\n")[0]
