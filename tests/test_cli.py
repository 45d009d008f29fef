"""The h2o-compile CLI on a random-weight model saved to a local folder."""

from __future__ import annotations

import pytest

from h2o_compile.cli import main


def test_generate_prints_text_memory_and_speed(model_dir, capsys):
    code = main(["generate", "--model", str(model_dir), "--budget", "0.5", "--prompt", "w1 w2 w3 w4 w5 w6",
                 "--max-new-tokens", "6", "--compile", "off"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("w1 w2 w3 w4 w5 w6 ")
    assert "KV cache: full" in out and "capacity 6 of 12 tokens" in out
    assert "tokens/s" in out


def test_generate_with_a_compile_mode_prints_the_same_greedy_text(model_dir, capsys):
    texts = []
    for mode in ("off", "reduce-overhead"):
        assert main(["generate", "--model", str(model_dir), "--budget", "0.5", "--prompt", "w1 w2 w3 w4 w5 w6",
                     "--max-new-tokens", "6", "--compile", mode]) == 0
        texts.append(capsys.readouterr().out.splitlines()[0])
    assert texts[0] == texts[1] and texts[0].startswith("w1 w2 w3 w4 w5 w6 ")


def test_bad_budget_is_one_line_error(model_dir, capsys):
    code = main(["generate", "--model", str(model_dir), "--budget", "1.5", "--prompt", "w1"])
    assert code == 2
    assert "budget=1.5" in capsys.readouterr().err


def test_missing_model_folder_is_an_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "not a folder with a config.json" in capsys.readouterr().err


def test_export_then_generate_with_onnx_backend_matches_torch(model_dir, tmp_path, capsys):
    out = tmp_path / "onnx"
    assert main(["export", "--model", str(model_dir), "-o", str(out), "--budget", "8", "--max-seq-len", "20"]) == 0
    assert (out / "model.onnx").is_file()
    capsys.readouterr()
    prompt = "w3 w9 w27 w81 w50 w12 w1 w8 w64 w30"
    assert main(["generate", str(out), "--backend", "onnx", "--prompt", prompt, "--max-new-tokens", "8"]) == 0
    onnx_text = capsys.readouterr().out.split("\n")[0]
    assert main(["generate", "--model", str(model_dir), "--budget", "8", "--prompt", prompt, "--max-new-tokens", "8",
                 "--compile", "off"]) == 0
    torch_text = capsys.readouterr().out.split("\n")[0]
    assert onnx_text == torch_text and len(onnx_text.split()) > 10  # the prompt + new words (EOS may stop early)


def test_model_arguments_take_gguf_files_and_zoo_names(tmp_path):
    from h2o_compile.zoo.loading import load_local

    with pytest.raises(FileNotFoundError, match="no such .gguf file"):
        load_local(str(tmp_path / "model.gguf"))
    with pytest.raises(ValueError, match="a .gguf file, or one of gemma3-270m, tiny"):
        load_local(str(tmp_path / "nothing-here"))
    model, tokenizer = load_local("tiny")
    assert model.config.model_type == "llama" and tokenizer("the river")["input_ids"]
