"""One report from several runs of the same evaluation: a sweep too slow for one process, split by budget or
policy across runs (``h2o-compile eval-merge``).

Runs merge only if they measured the same thing: the same model, texts and the settings that define a number
(window length and count, prompt block, generation prompts, whether sliding layers are compressed, the sink
tokens of h2o+sinks). Model and texts are compared by the names their reports carry (a folder's name, a text
file's name and the fraction read), so two different checkpoints in folders of the same name would pass. A
configuration measured by two runs must agree to ``REL_TOL`` (the evaluation is deterministic; eager and
compiled steps, or another batch size, differ by float rounding); otherwise the merge refuses.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from .evaluation import EvalResult

# Settings that change what a number means; budgets, policies, batch size and compile may differ between runs.
SAME_SETTINGS = ("seq_len", "num_seqs", "prompt_len", "gen_prompt_len", "gen_new_tokens", "gen_prompts",
                 "compress_sliding")
REL_TOL = 1e-4


def load_run(folder) -> dict:
    """The eval.json an ``h2o-compile eval`` run wrote in ``folder``, with budgets as floats."""
    path = Path(folder) / "eval.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no eval.json (give folders written by h2o-compile eval --out)")
    run = json.loads(path.read_text())
    for key in ("perplexity", "agreement", "kv_bytes"):
        run[key] = {label: {float(b): v for b, v in by.items()} for label, by in run.get(key, {}).items()}
    run["folder"] = str(folder)
    return run


def check_same_measurement(runs: Sequence[dict], keys: Sequence[str], setting_keys: Sequence[str]) -> None:
    """ValueError naming the first run whose ``keys`` (top level) or ``setting_keys`` (under "settings") differ
    from the first run's: only runs of the same measurement merge (eval-merge and tasks-merge)."""
    first = runs[0]
    for run in runs[1:]:
        for where, names in ((lambda r: r, keys), (lambda r: r["settings"], setting_keys)):
            for key in names:
                if where(run).get(key) != where(first).get(key):
                    raise ValueError(f"{run['folder']} has {key}={where(run).get(key)!r}, {first['folder']} "
                                     f"{where(first).get(key)!r}: only runs of the same measurement merge")


def merge_runs(runs: Sequence[dict]) -> EvalResult:
    """The union of the runs' configurations as one EvalResult (settings: the first run's, with every budget
    and policy). Raises ValueError when the runs measured different things or disagree on a configuration."""
    if not runs:
        raise ValueError("nothing to merge: give at least one run folder")
    first = runs[0]
    check_same_measurement(runs, ("model", "texts"), SAME_SETTINGS)
    sinks = {run["settings"].get("h2o_sinks", 0) for run in runs} - {0}
    if len(sinks) > 1:
        raise ValueError(f"the runs evaluate h2o with {sorted(sinks)} sink tokens: merge runs of one h2o_sinks")
    result = EvalResult(settings=dict(first["settings"]), reference_bytes=dict(first["reference_bytes"]))
    owner = {}  # (table, label, budget) -> folder that measured it first
    for run in runs:
        for table in ("perplexity", "agreement", "kv_bytes"):
            merged = getattr(result, table)
            for label, by in run[table].items():
                for budget, value in by.items():
                    where = (table, label, budget)
                    if where in owner and not _same(merged[label][budget], value):
                        raise ValueError(f"{label} at budget {budget}: {table} {merged[label][budget]} in "
                                         f"{owner[where]} but {value} in {run['folder']}")
                    owner.setdefault(where, run["folder"])
                    merged.setdefault(label, {})[budget] = value
    # What was measured (a run interrupted mid-sweep measured less than its settings say).
    result.settings.update(budgets=sorted({b for label, by in result.agreement.items() if label != "full"
                                           for b in by}),
                           policies=[label for label in result.agreement if "+" not in label],
                           h2o_sinks=sinks.pop() if sinks else 0)
    for key in ("batch_size", "compile"):  # may differ between runs: say so rather than keep the first's
        values = {json.dumps(run["settings"].get(key)) for run in runs}
        if len(values) > 1:
            result.settings[key] = "per run"
    return result


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return math.isclose(a, b, rel_tol=REL_TOL)
