"""Every bad input the library rejects, in one table: the error type, and a message that names the bad value
(and so tells the user what to change). Config, optimize, reset, step, generate, export, the ONNX model, the
zoo and the CLI."""

from __future__ import annotations

import pytest
import torch

import h2o_compile
from h2o_compile import H2OConfig, zoo
from h2o_compile.cli import main

from .runtime.arch_configs import VOCAB, build


@pytest.fixture(scope="module")
def opt():
    return h2o_compile.optimize(build("llama"), budget=0.5, compile=False)


@pytest.fixture(scope="module")
def ort_model(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    from h2o_compile.export.ort import H2OOrtModel

    out = h2o_compile.export_onnx(build("llama"), tmp_path_factory.mktemp("onnx"), budget=6, max_seq_len=16)
    return H2OOrtModel.from_pretrained(out, provider="cpu")


def _stepped(model, ids, **kwargs):
    model.reset(1, 16)
    return model.step(ids, **kwargs)


ids = torch.ones(1, 4, dtype=torch.long)

# (name, call(opt, ort_model), exception, text the message must contain)
CASES = [
    ("budget > 1", lambda m, o: H2OConfig(budget=1.5), ValueError, "budget=1.5"),
    ("budget 0", lambda m, o: H2OConfig(budget=0), ValueError, "budget=0"),
    ("budget bool", lambda m, o: H2OConfig(budget=True), TypeError, "budget"),
    ("budget str", lambda m, o: H2OConfig(budget="0.2"), TypeError, "'0.2'"),
    ("policy", lambda m, o: H2OConfig(policy="lru"), ValueError, "policy='lru'"),
    ("recent_ratio", lambda m, o: H2OConfig(recent_ratio=1.5), ValueError, "recent_ratio=1.5"),
    ("sink_tokens", lambda m, o: H2OConfig(sink_tokens=-1), ValueError, "sink_tokens=-1"),
    ("local with sinks", lambda m, o: H2OConfig(policy="local", sink_tokens=2), ValueError, "sink_tokens=2"),
    ("prefill str", lambda m, o: H2OConfig(prefill="chunked"), ValueError, "prefill='chunked'"),
    ("prefill 0", lambda m, o: H2OConfig(prefill=0), ValueError, "prefill=0"),
    ("seed", lambda m, o: H2OConfig(seed=-3), ValueError, "seed=-3"),
    ("compress_sliding", lambda m, o: H2OConfig(compress_sliding="yes"), ValueError, "compress_sliding='yes'"),
    ("sinks + recent > C", lambda m, o: H2OConfig(budget=4, sink_tokens=3), ValueError, "sink_tokens (3)"),
    ("compile", lambda m, o: h2o_compile.optimize(build("llama"), compile="fast"), ValueError, "compile='fast'"),
    ("not a model", lambda m, o: h2o_compile.optimize(torch.nn.Linear(2, 2)), TypeError, "Linear"),
    ("reset batch", lambda m, o: m.reset(0, 8), ValueError, "batch_size=0"),
    ("reset max_seq_len", lambda m, o: m.reset(1, -2), ValueError, "max_seq_len=-2"),
    ("beyond positions", lambda m, o: m.reset(1, 10_000), ValueError, "max_position_embeddings=128"),
    ("kept_positions layer", lambda m, o: (m.reset(1, 8), m.kept_positions(7)), ValueError, "layer=7"),
    ("step token id", lambda m, o: _stepped(m, torch.tensor([[1, VOCAB + 5]])), ValueError, f"token id {VOCAB + 5}"),
    ("step negative id", lambda m, o: _stepped(m, torch.tensor([[-1, 2]])), ValueError, "token id -1"),
    ("step batch", lambda m, o: _stepped(m, torch.ones(3, 2, dtype=torch.long)), ValueError, "batch=1"),
    ("step too long", lambda m, o: _stepped(m, torch.ones(1, 17, dtype=torch.long)), ValueError, "max_seq_len=16"),
    ("step mask shape", lambda m, o: _stepped(m, ids, attention_mask=torch.ones(1, 3)), ValueError, "(1, 3)"),
    ("generate float ids", lambda m, o: m.generate(ids.float()), ValueError, "torch.float32"),
    ("generate right padding", lambda m, o: m.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 0]])),
     ValueError, "pad prompts on the left"),
    # generate's own arguments are checked by transformers (GenerationConfig and its processors), in its words.
    ("generate max_new_tokens", lambda m, o: m.generate(ids, max_new_tokens=0), ValueError,
     "`max_new_tokens` must be greater than 0, but is 0"),
    ("generate temperature", lambda m, o: m.generate(ids, do_sample=True, temperature=0.0), ValueError,
     "`temperature` (=0.0) has to be a strictly positive float"),
    ("generate top_k", lambda m, o: m.generate(ids, do_sample=True, top_k=-1), ValueError,
     "`top_k` has to be a strictly positive integer, but is -1"),
    ("generate top_p", lambda m, o: m.generate(ids, do_sample=True, top_p=-0.5), ValueError,
     "`top_p` has to be a float > 0 and < 1, but is -0.5"),  # transformers reads top_p >= 1 as "no top-p"
    ("generate num_beams", lambda m, o: m.generate(ids, num_beams=3), ValueError, "num_beams=3"),
    ("generate unknown kwarg", lambda m, o: m.generate(ids, temprature=0.5), ValueError, "temprature"),
    ("onnx generate num_beams", lambda m, o: o.generate(ids, num_beams=2), ValueError, "num_beams=2"),
    ("generate token id", lambda m, o: m.generate(torch.tensor([[3, 10_000]])), ValueError, "token id 10000"),
    ("export opset", lambda m, o: h2o_compile.export_onnx(build("llama"), "/nonexistent", opset=11), ValueError,
     "opset=11"),
    ("export batch", lambda m, o: h2o_compile.export_onnx(build("llama"), "/nonexistent", batch_size=0),
     ValueError, "batch_size=0"),
    ("export max_seq_len", lambda m, o: h2o_compile.export_onnx(build("llama"), "/nonexistent", max_seq_len=0),
     ValueError, "max_seq_len=0"),
    ("onnx token id", lambda m, o: _stepped(o, torch.tensor([[2, VOCAB]])), ValueError, f"token id {VOCAB}"),
    ("onnx reset beyond export", lambda m, o: o.reset(1, 17), ValueError, "sequence of 17 tokens"),
    ("zoo name", lambda m, o: zoo.load_model("llama-70b"), ValueError, "'llama-70b'"),
    ("zoo dtype", lambda m, o: zoo.load_gemma3_270m(dtype="fp32"), TypeError, "'fp32'"),
]


@pytest.mark.parametrize("name,call,error,text", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_naming_the_value(opt, ort_model, name, call, error, text):
    with pytest.raises(error) as caught:
        call(opt, ort_model)
    assert text in str(caught.value), f"{name}: {caught.value}"


@pytest.mark.parametrize("argv,text", [
    (["generate", "--budget", "1.5", "--prompt", "w1"], "budget=1.5"),
    (["generate", "--budget", "0.5", "--prompt", "w1", "--max-new-tokens", "0"],
     "`max_new_tokens` must be greater than 0, but is 0"),
    (["generate", "--budget", "0.5", "--prompt", "w1", "--temperature", "0.7", "--top-p=-2"],
     "`top_p` has to be a float > 0 and < 1, but is -2.0"),
    (["export", "-o", "/nonexistent", "--opset", "12"], "opset=12"),
])
def test_cli_input_errors_are_one_line(model_dir, capsys, argv, text):
    argv = argv[:1] + ["--model", str(model_dir)] + argv[1:]
    assert main(argv) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after transformers' own loading bar
    assert last.startswith("error: ") and text in last and "Traceback" not in err


def test_cli_keeps_the_traceback_of_a_bug(model_dir, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("an internal bug, not an input error")

    monkeypatch.setattr(h2o_compile.cli, "optimize", broken)
    with pytest.raises(TypeError, match="internal bug"):
        main(["generate", "--model", str(model_dir), "--prompt", "w1", "--compile", "off"])


def test_capture_says_which_attention_it_traced_and_leaves_the_model_as_given():
    model = build("llama")
    model.config._attn_implementation = "paged|eager"
    with pytest.warns(UserWarning, match="attn_implementation='paged\\|eager' cannot be captured; .* 'sdpa'"):
        h2o_compile.optimize(model, compile=False)
    assert model.config._attn_implementation == "paged|eager"
