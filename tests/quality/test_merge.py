"""eval-merge: runs split by budget and policy merge into the report one run of everything writes."""

from __future__ import annotations

import json

import pytest

from h2o_compile.cli import main
from h2o_compile.quality.merge import load_run, merge_runs
from tests.quality.test_evaluation import TEXT

SETTINGS = ["--seq-len", "24", "--num-seqs", "2", "--prompt-len", "4", "--gen-prompt-len", "10",
            "--gen-new-tokens", "4", "--gen-prompts", "1", "--compile", "off"]


def run_eval(model_dir, text, out, budgets, policies, *extra):
    code = main(["eval", "--model", str(model_dir), "--text", str(text), "--budgets", budgets, "--policies",
                 policies, *SETTINGS, *extra, "--out", str(out)])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("merge")
    text = tmp / "text.txt"
    text.write_text(TEXT)
    return {"text": text, "whole": run_eval(model_dir, text, tmp / "whole", "0.25,0.5", "full,h2o,random"),
            "a": run_eval(model_dir, text, tmp / "a", "0.25", "full,h2o"),
            "b": run_eval(model_dir, text, tmp / "b", "0.5", "h2o,random"),
            "c": run_eval(model_dir, text, tmp / "c", "0.25", "random")}


def test_split_runs_merge_into_what_one_run_measures(runs, tmp_path):
    assert main(["eval-merge", str(runs["a"]), str(runs["b"]), str(runs["c"]), "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "eval.json").read_text())
    whole = json.loads((runs["whole"] / "eval.json").read_text())
    for key in ("perplexity", "agreement", "kv_bytes"):
        assert merged[key] == {label: whole[key][label] for label in merged[key]}
        assert set(merged[key]) == set(whole[key])
    assert merged["settings"]["budgets"] == [0.25, 0.5]
    assert [s["folder"] for s in merged["sources"]] == [str(runs[k]) for k in "abc"]
    table = (tmp_path / "eval.md").read_text()
    best = min(whole["perplexity"]["h2o"]["0.25"], whole["perplexity"]["random"]["0.25"])
    assert f"**{best:.2f} (" in table  # the best policy of the budget's row
    assert "Merged from 3 runs" in table and "Time (the runs together)" in table
    assert merged["machine"] == whole["machine"]  # where the runs measured
    assert (tmp_path / "eval_perplexity.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("extra, match", [(["--prompt-len", "6"], "prompt_len=6"),
                                          (["--compress-sliding"], "compress_sliding=True"),
                                          (["--tail", "0.5"], "texts=")])
def test_runs_of_different_measurements_do_not_merge(runs, model_dir, tmp_path, extra, match):
    other = run_eval(model_dir, runs["text"], tmp_path / "other", "0.5", "h2o", *extra)
    with pytest.raises(ValueError, match=match + ".*only runs of the same measurement merge"):
        merge_runs([load_run(runs["a"]), load_run(other)])


def test_h2o_with_different_sink_counts_does_not_merge(runs, model_dir, tmp_path):
    one = run_eval(model_dir, runs["text"], tmp_path / "one", "0.5", "h2o", "--h2o-sinks", "1")
    two = run_eval(model_dir, runs["text"], tmp_path / "two", "0.5", "local", "--h2o-sinks", "2")
    with pytest.raises(ValueError, match=r"h2o with \[1, 2\] sink tokens"):
        merge_runs([load_run(one), load_run(two)])


def test_a_row_with_one_measured_policy_marks_none_best(runs, tmp_path):
    """b measured h2o and random at 0.5 only, c random at 0.25 only: the 0.25 row holds one value."""
    assert main(["eval-merge", str(runs["b"]), str(runs["c"]), "--out", str(tmp_path)]) == 0
    rows = [line for line in (tmp_path / "eval.md").read_text().splitlines() if line.startswith("| 0.25 |")]
    assert len(rows) == 1 and "**" not in rows[0] and "| - |" in rows[0]


def test_a_configuration_measured_twice_must_agree(runs):
    first, second = load_run(runs["a"]), load_run(runs["whole"])
    assert merge_runs([first, second]).perplexity["h2o"][0.25] == first["perplexity"]["h2o"][0.25]
    second["perplexity"]["h2o"][0.25] *= 1.01
    with pytest.raises(ValueError, match="h2o at budget 0.25: perplexity"):
        merge_runs([first, second])


def test_a_folder_without_a_run_or_an_out_among_the_runs_is_a_clear_error(runs, tmp_path, capsys):
    assert main(["eval-merge", str(runs["a"]), str(runs["b"]), "--out", str(runs["b"])]) == 2
    assert "is one of the runs to merge" in capsys.readouterr().err
    assert main(["eval-merge", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    with pytest.raises(FileNotFoundError, match="no eval.json"):
        load_run(tmp_path)
