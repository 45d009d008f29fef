"""benchmarks/task_prompt_diff.py: per-prompt differences between two task results, on hand-made rows."""

from __future__ import annotations

import json

import pytest

from ..helpers import load_benchmark

diff = load_benchmark("task_prompt_diff")


def _write(folder, rows):
    folder.mkdir()
    (folder / "tasks.json").write_text(json.dumps({"rows": rows}))
    return str(folder)


def _row(index, score, budget=0.1, task="passkey"):
    return dict(index=index, score=score, budget=budget, task=task, rule="max+decay=0.99")


def test_filters_pick_one_configuration_and_the_differences_are_named(tmp_path):
    a = _write(tmp_path / "a", [_row(i, s) for i, s in enumerate([1, 1, 0, 1])] + [_row(0, 0.0, budget=0.2)])
    b = _write(tmp_path / "b", [_row(i, s) for i, s in enumerate([1, 0, 1, 0])])
    got = diff.scores(a, ["budget=0.1", "rule=max+decay=0.99"])
    assert got == {0: 1, 1: 1, 2: 0, 3: 1}
    assert diff.compare(got, diff.scores(b, [])) == ([1, 3], [2])


def test_rows_matching_twice_per_sample_and_bad_filters_are_errors(tmp_path, capsys):
    a = _write(tmp_path / "a", [_row(0, 1.0), _row(0, 0.0, budget=0.2)])
    with pytest.raises(ValueError, match="2 rows for 1 samples"):
        diff.scores(a, [])
    with pytest.raises(ValueError, match="expected field=value"):
        diff.scores(a, ["budget"])
    with pytest.raises(SystemExit):
        diff.main([a, "--against", a])
    assert "add a filter" in capsys.readouterr().err


def test_the_every_nth_subset_is_reported(tmp_path, capsys):
    a = _write(tmp_path / "a", [_row(i, 1.0) for i in range(10)])
    b = _write(tmp_path / "b", [_row(i, float(i % 2)) for i in range(10)])
    assert diff.main([a, "--against", b, "--every", "5"]) == 0
    out = capsys.readouterr().out
    assert "A above B on 5 samples [0, 2, 4, 6, 8]" in out and "every 5th (2 samples): A 2, B 1" in out
