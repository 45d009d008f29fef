"""lm-evaluation-harness on a local task (its data written here, no hub): the shipped model gives the same
figures through lm-eval's HFLM as the registered ``h2o`` model and an H2OModel passed to HFLM at a covering
budget (within float noise), for loglikelihood, rolling loglikelihood and generate_until requests; an evicting
budget changes them (the settings reach the model)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when datasets is imported (inside the tests)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval")

import h2o_compile  # noqa: E402

SENTENCES = ["the old man looked at the sea", "once upon a time there was a king", "the river ran past the town",
             "she opened the door and saw the garden", "the ship sailed out of the harbour at dawn"]

TASKS = {
    "h2o_choice": """task: h2o_choice
dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{prefix}}"
doc_to_choice: "{{choices}}"
doc_to_target: 0
metric_list: [{metric: acc}]
""",
    "h2o_rolling": """task: h2o_rolling
dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: "{{text}}"
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}, {metric: bits_per_byte}]
""",
    "h2o_generate": """task: h2o_generate
dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
output_type: generate_until
doc_to_text: "{{prefix}}"
doc_to_target: "{{rest}}"
generation_kwargs: {until: ["."], max_gen_toks: 12, do_sample: false}
metric_list: [{metric: exact_match}]
""",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    data = folder / "data.jsonl"
    rows = []
    for i, sentence in enumerate(SENTENCES):
        words = sentence.split()
        other = SENTENCES[(i + 1) % len(SENTENCES)].split()
        rows.append({"prefix": " ".join(words[:3]), "rest": " " + " ".join(words[3:]), "text": sentence * 6,
                     "choices": [" " + " ".join(words[3:]), " " + " ".join(other[3:])]})
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for name, text in TASKS.items():
        (folder / f"{name}.yaml").write_text(text.replace("DATA", str(data)))
    return folder


def _evaluate(model, task_dir, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, tasks=list(TASKS), task_manager=TaskManager(include_path=str(task_dir)),
                                  batch_size=2, **kwargs)
    return {task: {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k}
            for task, metrics in out["results"].items()}  # "word_perplexity,none" -> "word_perplexity"


def _close(a: dict, b: dict, tol: float = 1e-4) -> bool:
    return a.keys() == b.keys() and all(abs(a[t][m] - b[t][m]) <= tol * max(1.0, abs(a[t][m])) for t in a for m in a[t])


def test_h2o_at_a_covering_budget_gives_the_original_models_figures(task_dir):
    from lm_eval.models.huggingface import HFLM

    from h2o_compile.integrations import lm_eval_model  # noqa: F401  (registers "h2o")

    model, tokenizer = h2o_compile.load_tiny()
    original = _evaluate(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2), task_dir)
    assert set(original) == set(TASKS) and original["h2o_rolling"]["word_perplexity"] > 1.0
    wrapped = _evaluate(HFLM(pretrained=h2o_compile.optimize(model, budget=1.0), tokenizer=tokenizer, batch_size=2),
                        task_dir)
    assert _close(original, wrapped), (original, wrapped)
    registered = _evaluate("h2o", task_dir, model_args=f"pretrained={h2o_compile.zoo.TINY_LLAMA_DIR},budget=1.0,"
                                                      "config=recommended,dtype=float32")
    assert _close(original, registered), (original, registered)
    evicting = _evaluate("h2o", task_dir, model_args=f"pretrained={h2o_compile.zoo.TINY_LLAMA_DIR},budget=4,"
                                                     "dtype=float32")
    assert evicting["h2o_rolling"]["word_perplexity"] != pytest.approx(original["h2o_rolling"]["word_perplexity"],
                                                                       rel=1e-3)


def test_a_bad_h2o_setting_fails_before_the_model_loads(tmp_path):
    from h2o_compile.integrations.lm_eval_model import H2OLM

    with pytest.raises(ValueError, match="decay=2"):
        H2OLM(pretrained=str(tmp_path / "no-model-here"), config="max+decay=2")
