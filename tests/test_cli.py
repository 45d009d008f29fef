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


def test_bad_budget_is_one_line_error(model_dir, capsys):
    code = main(["generate", "--model", str(model_dir), "--budget", "1.5", "--prompt", "w1"])
    assert code == 2
    assert "budget=1.5" in capsys.readouterr().err


def test_missing_model_folder_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="not a folder with a config.json"):
        main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
