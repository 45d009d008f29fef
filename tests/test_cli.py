"""The h2o-compile CLI on a random-weight model saved to a local folder."""

from __future__ import annotations

import pytest

import h2o_compile

from h2o_compile.cli import build_parser, main

SUBCOMMANDS = ["demo", "generate", "export", "eval", "eval-merge", "stream", "tasks", "tasks-merge", "calibrate",
               "serve", "bench"]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help_with_defaults_and_takes_model_and_out(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--out" in text or command in ("generate", "serve")  # they print or serve, they write nothing
    if command not in ("eval-merge", "tasks-merge"):
        assert "--model" in text and "--budget" in text
    if command in ("generate", "export"):
        assert "--preset" in text and "--rule" in text and "(default: paper)" in text
    assert "docs/results" not in text  # no command writes into the package's results by default


def test_version_and_the_subcommand_list(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"h2o-compile {h2o_compile.__version__}"
    choices = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert sorted(choices) == sorted(SUBCOMMANDS)


def test_preset_and_rule_make_the_config_in_the_one_syntax():
    from h2o_compile.cli import config_of

    parser = build_parser()
    args = parser.parse_args(["generate", "--model", "m", "--prompt", "p", "--preset", "recommended",
                              "--rule", "decay=0.9", "--budget", "0.1", "--kv-dtype", "int8"])
    config = config_of(args)
    recommended = h2o_compile.PRESETS["recommended"]
    assert config == recommended.replace(decay=0.9, budget=0.1, kv_dtype="int8")
    args = parser.parse_args(["export", "--model", "m", "--rule", "tova+recent_ratio=0.1"])
    assert config_of(args) == h2o_compile.H2OConfig.parse("tova+recent_ratio=0.1")
    assert config_of(parser.parse_args(["generate", "--model", "m", "--prompt", "p"])) == h2o_compile.PRESETS["paper"]


def test_a_bad_rule_is_a_one_line_error(capsys):
    assert main(["export", "--model", "tiny", "--rule", "decay=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "decay" in err and len(err.strip().splitlines()) == 1


def test_a_missing_extra_is_named(monkeypatch):
    import importlib.util

    from h2o_compile.cli import arguments

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ImportError, match=r"h2o-compile eval needs matplotlib: pip install 'h2o-compile\[eval\]'"):
        arguments.require("eval", "matplotlib")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"h2o-compile\[onnx\].*onnx-gpu"):
        arguments.require("export", "onnx")


def test_default_out_is_a_new_folder_under_the_current_directory(tmp_path, monkeypatch):
    from h2o_compile.cli.arguments import default_out

    monkeypatch.chdir(tmp_path)
    first = default_out("eval")
    assert first.parent == tmp_path / "runs" and first.name.startswith("eval-") and not first.exists()
    first.mkdir(parents=True)
    assert default_out("eval") != first


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
    assert main(["generate", "--model", str(out), "--backend", "onnx", "--prompt", prompt,
                 "--max-new-tokens", "8"]) == 0
    onnx_text = capsys.readouterr().out.split("\n")[0]
    assert main(["generate", "--model", str(model_dir), "--budget", "8", "--prompt", prompt, "--max-new-tokens", "8",
                 "--compile", "off"]) == 0
    torch_text = capsys.readouterr().out.split("\n")[0]
    assert onnx_text == torch_text and len(onnx_text.split()) > 10  # the prompt + new words (EOS may stop early)


def test_model_arguments_take_gguf_files_and_zoo_names(tmp_path):
    from h2o_compile.zoo.loading import load_pretrained

    with pytest.raises(FileNotFoundError, match="no such .gguf file"):
        load_pretrained(str(tmp_path / "model.gguf"))
    with pytest.raises(ValueError, match="a .gguf file, or one of gemma3-270m, tiny"):
        load_pretrained(str(tmp_path / "nothing-here"))
    model, tokenizer = load_pretrained("tiny")
    assert model.config.model_type == "llama" and tokenizer("the river")["input_ids"]


def test_calibrate_writes_the_split_it_prints(model_dir, tmp_path, capsys):
    """calibrate: the printed rule string, h2o_config.json and calibrate() on the same tokens are one config, split
    between layers or KV heads too; the plot and the statistics are written; too short a text is a one-line error."""
    import json

    import torch
    from transformers import AutoTokenizer

    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 37 + 1}" for i in range(400)))
    out = tmp_path / "split"
    args = ["calibrate", "--model", str(model_dir), "--text", str(text), "--tokens", "48", "--rows", "2",
            "--budget", "0.25", "--preset", "recommended"]
    assert main(args + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    written = h2o_compile.H2OConfig.from_dict(json.loads((out / "h2o_config.json").read_text()))
    assert f"rule string: {written.to_string()}" in printed
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text.read_text(), add_special_tokens=False).input_ids
    rows = torch.tensor([ids[:48], ids[48:96]])  # the word tokenizer adds no BOS: two stretches of the text
    model = h2o_compile.zoo.loading.load_pretrained(str(model_dir))[0]
    assert written == h2o_compile.calibrate(model, rows, 0.25, config="recommended")
    split = json.loads((out / "split.json").read_text())
    assert len(split["allocation"]) == len(split["kept_mass"]) == 2 and (out / "split.png").stat().st_size > 0
    heads = model.config.num_key_value_heads
    assert sum(map(sum, split["slots"])) <= 2 * heads * split["capacity"] and isinstance(written.allocation, tuple)
    assert main(args + ["--head-groups", "2", "--out", str(out)]) == 0  # and per KV head
    written = h2o_compile.H2OConfig.from_dict(json.loads((out / "h2o_config.json").read_text()))
    assert written == h2o_compile.calibrate(model, rows, 0.25, config="recommended", head_groups=2)
    assert f"rule string: {written.to_string()}" in capsys.readouterr().out
    assert main(args[:-4] + ["--tokens", "4000"]) == 2
    assert "needs 8000" in capsys.readouterr().err

