"""Prompt by prompt: which samples one task configuration answers and another does not.

Two ``h2o-compile tasks`` results (tasks.json) may hold the same task file's prompts under different rules or
budgets; their accuracies alone do not say whether one finds a superset of the other's keys. Each side is a
folder and ``field=value`` filters on its rows (the row fields of tasks.json: task, budget, policy, rule,
recent_ratio, ...). Prints each side's count, the sample indices where A scores above or below B, and the same
on every ``--every``-th sample (the kvpress comparison ran on indices 0, 5, ..., 45 of the 50):

    python research/task_prompt_diff.py \\
        docs/results/tasks_gemma3/passkey4096_50_peak task=passkey budget=0.1 \\
        --against docs/results/tasks_gemma3/passkey4096_50_b0.1_0.5_decay task=passkey budget=0.1 --every 5
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _value(text: str):
    """A filter value as tasks.json stores it: a number when it reads as one, else the string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def scores(folder: str, filters: list[str]) -> dict[int, float]:
    """Sample index -> score of the rows of ``folder``/tasks.json matching every ``field=value`` filter.
    A ValueError when a filter is malformed or the rows match twice per index (a filter is missing)."""
    match = {}
    for item in filters:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"filter {item!r}: expected field=value")
        match[name] = _value(value)
    rows = json.loads((Path(folder) / "tasks.json").read_text())["rows"]
    picked = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    by_index = {r["index"]: r["score"] for r in picked}
    if len(by_index) != len(picked):
        raise ValueError(f"{folder} with {filters}: {len(picked)} rows for {len(by_index)} samples; add a filter "
                         "(task, budget, rule, policy, ...)")
    return by_index


def compare(a: dict[int, float], b: dict[int, float]) -> tuple[list[int], list[int]]:
    """(indices where A scores above B, where below), over the samples both hold."""
    common = sorted(set(a) & set(b))
    return [i for i in common if a[i] > b[i]], [i for i in common if a[i] < b[i]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("filters", nargs="*", help="field=value filters on the rows of A")
    parser.add_argument("--against", nargs="+", required=True, metavar="FOLDER [field=value ...]",
                        help="B: a folder and its filters")
    parser.add_argument("--every", type=int, default=0, help="also report samples 0, N, 2N, ... alone")
    args = parser.parse_args(argv)
    try:
        a = scores(args.folder, args.filters)
        b = scores(args.against[0], args.against[1:])
    except ValueError as error:
        parser.error(str(error))
    more, fewer = compare(a, b)
    print(f"A {sum(a.values()):g} of {len(a)}; B {sum(b.values()):g} of {len(b)}")
    print(f"A above B on {len(more)} samples {more}; below on {len(fewer)} {fewer}")
    if args.every > 0:
        subset = [i for i in sorted(set(a) & set(b)) if i % args.every == 0]
        print(f"every {args.every}th ({len(subset)} samples): A {sum(a[i] for i in subset):g}, "
              f"B {sum(b[i] for i in subset):g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
