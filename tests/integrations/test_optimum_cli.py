"""``optimum-cli export h2o`` (registered through optimum's ``optimum.commands.register`` namespace) writes the
folder ``h2o-compile export`` writes for the same flags: the same files, the same h2o_config.json and the same
ONNX graph and weights; and the same one-line error for a bad configuration. The exported model then serves
transformers' text-generation pipeline and generate with a GenerationConfig, with H2OModel's tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from h2o_compile.cli import main

onnx = pytest.importorskip("onnx")
pytest.importorskip("optimum.commands.optimum_cli")
pytest.importorskip("onnxscript")

FLAGS = ["--budget", "6", "--preset", "tova", "--max-seq-len", "64"]  # an int budget: the same slots as H2OModel


def _optimum_cli(*args, cwd):
    code = "import sys; from optimum.commands.optimum_cli import main; sys.argv[0] = 'optimum-cli'; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


def _graph(folder: Path):
    model = onnx.load(str(folder / "model.onnx"))
    weights = {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in model.graph.initializer}
    return [n.op_type for n in model.graph.node], weights, [f.name for f in model.functions]


@pytest.fixture(scope="module")
def ours(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "ours"
    assert main(["export", "--model", str(model_dir), "--out", str(out), *FLAGS]) == 0
    return out


def test_optimum_cli_export_h2o_writes_what_h2o_compile_export_writes(model_dir, ours, tmp_path):
    done = _optimum_cli("export", "h2o", "--model", model_dir, "--out", tmp_path / "optimum", *FLAGS, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = tmp_path / "optimum"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    assert (ours / "h2o_config.json").read_text() == (theirs / "h2o_config.json").read_text()
    assert _graph(ours) == _graph(theirs)


def test_optimum_cli_lists_the_command_and_reports_a_bad_configuration_in_one_line(model_dir, tmp_path):
    listed = _optimum_cli("export", "--help", cwd=tmp_path)
    assert listed.returncode == 0 and "h2o" in listed.stdout
    bad = _optimum_cli("export", "h2o", "--model", model_dir, "--rule", "max+decay=2", cwd=tmp_path)
    assert bad.returncode == 2 and "decay=2" in bad.stderr and "Traceback" not in bad.stderr


def test_the_export_serves_transformers_pipeline_and_generation_config(model_dir, ours):
    pytest.importorskip("onnxruntime")
    from transformers import AutoModelForCausalLM, GenerationConfig, pipeline

    import h2o_compile

    exported = h2o_compile.H2OOrtModel.from_pretrained(ours, provider="cpu", native=False)
    opt = h2o_compile.optimize(AutoModelForCausalLM.from_pretrained(model_dir), config="tova", budget=6)
    prompts = ["w1 w2 w3 w4 w5 w6", "w7 w8"]
    for model in (exported, opt):
        model.generation_config.pad_token_id = exported.tokenizer.eos_token_id
    texts = [pipeline("text-generation", model=m, tokenizer=exported.tokenizer)(prompts, max_new_tokens=12,
                                                                               do_sample=False)
             for m in (exported, opt)]
    assert texts[0] == texts[1] and texts[0][0][0]["generated_text"].startswith(prompts[0])
    ids = exported.tokenizer(prompts[0], return_tensors="pt")["input_ids"]
    config = GenerationConfig(max_new_tokens=10, do_sample=False)
    assert (exported.generate(ids, generation_config=config) == opt.generate(ids, generation_config=config)).all()
