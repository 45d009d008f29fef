"""tasks writes its prompts as a task file; tasks-merge joins runs split by sample range and configuration into
the report one run of everything writes, and refuses runs of other prompts or disagreeing scores."""

from __future__ import annotations

import json

import pytest

from h2o_compile.cli import main
from h2o_compile.quality.task_merge import load_task_run, merge_task_rows
from h2o_compile.quality.tasks import read_samples

FILLER = " ".join(f"w{i % 90} w{(7 * i) % 90}" for i in range(1500))


def run_tasks_cli(model_dir, text, out, *extra):
    code = main(["tasks", "--model", str(model_dir), "--tasks", "passkey", "--lengths", "100", "--samples", "4",
                 "--budgets", "0.2", "--policies", "h2o,sink", "--text", str(text), *extra, "--out", str(out)])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("task_merge")
    text = tmp / "filler.txt"
    text.write_text(FILLER)
    return {"text": text, "whole": run_tasks_cli(model_dir, text, tmp / "whole"),
            "a": run_tasks_cli(model_dir, text, tmp / "a", "--part", "0:2"),
            "b": run_tasks_cli(model_dir, text, tmp / "b", "--part", "2:4", "--policies", "h2o"),
            "c": run_tasks_cli(model_dir, text, tmp / "c", "--part", "2:4", "--policies", "sink", "--no-full")}


def _rows(folder):
    rows = json.loads((folder / "tasks.json").read_text())["rows"]
    return sorted((r["label"], r["budget"], r["index"], r["score"], r["output"]) for r in rows)


def test_the_task_file_holds_the_prompts_that_were_run(runs):
    whole = read_samples(runs["whole"] / "samples.jsonl")
    assert [s.index for s in whole] == [0, 1, 2, 3] and all(len(s.prompt_ids) == 100 for s in whole)
    part = read_samples(runs["b"] / "samples.jsonl")
    assert [s.index for s in part] == [2, 3]
    assert [s.prompt_ids for s in part] == [s.prompt_ids for s in whole[2:]]  # a part is a slice of the grid
    line = json.loads((runs["whole"] / "samples.jsonl").read_text().splitlines()[0])
    assert line["seed"] == 0 and line["max_new_tokens"] == 10 and line["prompt"].startswith("w")


def test_split_runs_merge_into_what_one_run_measures(runs, tmp_path):
    out = tmp_path / "merged"
    assert main(["tasks-merge", str(out), str(runs["a"]), str(runs["b"]), str(runs["c"])]) == 0
    assert _rows(out) == _rows(runs["whole"])
    assert (out / "samples.jsonl").read_text() != ""
    assert [s.prompt_ids for s in read_samples(out / "samples.jsonl")] == \
        [s.prompt_ids for s in read_samples(runs["whole"] / "samples.jsonl")]
    report = (out / "tasks.md").read_text()
    assert "Merged from 3 runs" in report and "(4)" in report  # 4 samples behind each cell
    assert (out / "passkey_depth_heatmap.png").read_bytes()[:4] == b"\x89PNG"


def test_other_prompts_do_not_merge(runs, model_dir, tmp_path):
    other = run_tasks_cli(model_dir, runs["text"], tmp_path / "seed1", "--part", "2:4", "--seed", "1")
    with pytest.raises(ValueError, match="seed=1.*only runs of the same measurement merge"):
        merge_task_rows([load_task_run(runs["a"]), load_task_run(other)])


def test_a_disagreeing_score_or_overwriting_a_run_is_refused(runs, tmp_path):
    a, b = load_task_run(runs["whole"]), load_task_run(runs["a"])
    b["rows"][0]["score"] = 1.0 - b["rows"][0]["score"]
    with pytest.raises(ValueError, match="score .* but"):
        merge_task_rows([a, b])
    assert main(["tasks-merge", str(runs["a"]), str(runs["a"]), str(runs["b"])]) == 2


def test_a_stepped_part_measures_those_samples_of_the_whole_run(runs, model_dir, tmp_path):
    every_other = run_tasks_cli(model_dir, runs["text"], tmp_path / "step", "--part", "1:4:2")
    assert [s.index for s in read_samples(every_other / "samples.jsonl")] == [1, 3]
    assert _rows(every_other) == [row for row in _rows(runs["whole"]) if row[2] in (1, 3)]


@pytest.mark.parametrize("part", ["3:9", "2:1", "0:4:0", "0:4:x", "1:2:3:4", "4"])
def test_bad_part_is_named(runs, model_dir, tmp_path, part, capsys):
    assert main(["tasks", "--model", str(model_dir), "--samples", "4", "--part", part, "--text", str(runs["text"]),
                 "--out", str(tmp_path)]) == 2
    assert f"--part {part!r}" in capsys.readouterr().err


def test_bad_kv_dtype_is_named(runs, model_dir, tmp_path, capsys):
    assert main(["tasks", "--model", str(model_dir), "--samples", "4", "--kv-dtypes", "int4", "--text",
                 str(runs["text"]), "--out", str(tmp_path)]) == 2
    assert "int4" in capsys.readouterr().err


def test_a_global_share_rule_without_compressed_sliding_layers_is_named(runs, model_dir, tmp_path, capsys):
    assert main(["tasks", "--model", str(model_dir), "--samples", "4", "--rules", "global=2", "--text",
                 str(runs["text"]), "--out", str(tmp_path)]) == 2
    assert "set compress_sliding=True" in capsys.readouterr().err
