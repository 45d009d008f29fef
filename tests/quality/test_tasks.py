"""The retrieval tasks: prompts of the exact length with the needle where the depth says, answers a reader of the
prompt would give, seeded; the runner and report on the tiny model; the rule presets."""

from __future__ import annotations

import json

import pytest
import torch

from h2o_compile import zoo
from h2o_compile.config import parse_options
from h2o_compile.quality.task_eval import TaskConfig, TaskRun, run_tasks
from h2o_compile.quality.task_report import write_task_report
from h2o_compile.quality.tasks import TASKS, make_samples


@pytest.fixture(scope="module")
def tiny():
    return zoo.load_model("tiny", torch.float32)


@pytest.fixture(scope="module")
def filler(tiny):
    _, tokenizer = tiny
    text = " ".join(f"Sentence number {i} of the filler talks about nothing in particular." for i in range(400))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("task", TASKS)
def test_prompts_have_the_length_and_hold_their_answers(tiny, filler, task):
    _, tokenizer = tiny
    samples = make_samples(task, tokenizer, filler, 300, 5, seed=1)
    assert [s.depth for s in samples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    for sample in samples:
        assert len(sample.prompt_ids) == 300
        text = tokenizer.decode(sample.prompt_ids)
        assert all(answer in text for answer in sample.answers)  # the prompt holds every answer
        assert sample.score(" ".join(sample.answers)) == 1.0 and sample.score("nothing") == 0.0
    again = make_samples(task, tokenizer, filler, 300, 5, seed=1)
    assert [s.prompt_ids for s in again] == [s.prompt_ids for s in samples]
    assert make_samples(task, tokenizer, filler, 300, 5, seed=2)[0].prompt_ids != samples[0].prompt_ids


def test_the_pass_key_sits_at_its_depth(tiny, filler):
    _, tokenizer = tiny
    for sample in make_samples("passkey", tokenizer, filler, 400, 3):
        text = tokenizer.decode(sample.prompt_ids)
        where = text.index(f"The pass key is {sample.answers[0]}") / len(text)
        assert abs(where - sample.depth) < 0.15, (where, sample.depth)


def test_multikey_asks_one_key_among_distractors(tiny, filler):
    _, tokenizer = tiny
    sample = make_samples("multikey", tokenizer, filler, 400, 1)[0]
    assert len(sample.meta["distractors"]) == 3 and sample.answers[0] not in sample.meta["distractors"]
    assert sample.score(sample.meta["distractors"][0]) == 0.0


def test_vartrack_scores_the_share_of_the_chain(tiny, filler):
    _, tokenizer = tiny
    sample = make_samples("vartrack", tokenizer, filler, 400, 1)[0]
    assert len(sample.answers) == 5
    assert sample.score(" ".join(sample.answers[:2])) == pytest.approx(0.4)


def test_bad_task_arguments_are_named(tiny, filler):
    _, tokenizer = tiny
    with pytest.raises(ValueError, match="task='needle'"):
        make_samples("needle", tokenizer, filler, 300, 2)
    with pytest.raises(ValueError, match="length=40 is too short"):
        make_samples("vartrack", tokenizer, filler, 40, 2)
    with pytest.raises(ValueError, match="a prompt needs"):
        make_samples("passkey", tokenizer, filler[:100], 300, 2)


@pytest.mark.parametrize("text,want", [
    ("sum", {"score": "sum"}), ("mean", {"score": "mean"}), ("tova", {"decay": 0.0}),
    ("snapkv", {"prompt_window": 64, "prompt_pool": 5}),
    ("mean+window=32+pool=3", {"score": "mean", "prompt_window": 32, "prompt_pool": 3}),
    ("decay=0.99", {"decay": 0.99}),
    ("window=64+pool=9+recent=0.1", {"prompt_window": 64, "prompt_pool": 9, "recent_ratio": 0.1}),
    ("global=2+decay=0.99", {"global_share": 2.0, "decay": 0.99}),
    ("max+decay=0.99+window=64+pool=21", {"score": "max", "decay": 0.99, "prompt_window": 64,
                                          "prompt_pool": 21}),
    ("global=2+max+sliding=sum", {"global_share": 2.0, "score": "max", "sliding_score": "sum"}),
])
def test_rule_options(text, want):
    assert parse_options(text) == want


def test_a_task_configuration_takes_its_recent_ratio_once():
    """recent= is for eval's rule rows; a task configuration has recent_ratio of its own, so a rule carrying it
    too is refused when the configuration is made (before any sample runs), whatever the two values are."""
    for ratio in (0.5, 0.1):
        with pytest.raises(ValueError, match="recent= belongs to eval"):
            TaskConfig("h2o", 0.2, "window=64+recent=0.1", recent_ratio=ratio)
    assert TaskConfig("sink", 0.2, "sum", recent_ratio=0.1).optimize_kwargs()["recent_ratio"] == 0.1


def test_bad_rule_option_is_named():
    with pytest.raises(ValueError, match="cannot read 'windw=3'"):
        parse_options("mean+windw=3")


@pytest.mark.parametrize("text,part,field", [
    ("mean+max", "max", "score"), ("tova+decay=0.9", "decay=0.9", "decay"),
    ("window=8+snapkv", "snapkv", "prompt_window")])
def test_an_option_given_twice_is_named(text, part, field):
    with pytest.raises(ValueError, match=f"'{part}' sets {field}"):
        parse_options(text)


def test_runner_and_report_on_the_tiny_model(tiny, filler, tmp_path):
    """The full cache and H2O with a budget covering the prompt give the same answers; the report has every
    configuration, the depth table and the heat map."""
    model, tokenizer = tiny
    samples = make_samples("passkey", tokenizer, filler, 200, 3)
    configs = [TaskConfig("full"), TaskConfig("h2o", 1.0, "snapkv"), TaskConfig("sink", 0.2)]
    run = run_tasks(model, tokenizer, samples, configs, progress=False)
    assert len(run.rows) == 9
    outputs = {c.label: [r["output"] for r in run.rows if r["label"] == c.label] for c in configs}
    assert outputs["full cache"] == outputs["h2o [snapkv]"]  # nothing evicted: the same greedy text
    paths = write_task_report(run, tmp_path, model_name="tiny", settings={"samples": 3})
    report = paths["markdown"].read_text()
    assert "## passkey, 200 tokens" in report and "h2o [snapkv] @ 1.0" in report and "sink @ 0.2" in report
    assert paths["heatmap"].stat().st_size > 0 and paths["plot_passkey_200"].stat().st_size > 0
    assert len(json.loads(paths["json"].read_text())["rows"]) == 9
    # the state each answer had: every layer and KV head, C slots of key + value (fp32) + score fp32 + position
    # int64; C = 210 tokens (200 + 10 new) for the full cache and h2o at 1.0, ceil(0.2 x 210) = 42 for sink
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_slot = config.num_hidden_layers * config.num_key_value_heads * (2 * head_dim * 4 + 4 + 8)
    assert {c.label: {r["kv_bytes"] for r in run.rows if r["label"] == c.label} for c in configs} == {
        "full cache": {210 * per_slot}, "h2o [snapkv]": {210 * per_slot}, "sink": {42 * per_slot}}
    assert f"| sink | {42 * per_slot / 2**20:.2f} | - |" in report  # budgets 0.2, 1.0


def test_accuracy_by_depth_band():
    run = TaskRun(rows=[dict(task="passkey", depth=d, label="x", score=s)
                        for d, s in [(0.0, 1.0), (0.1, 0.0), (0.5, 1.0), (1.0, 1.0)]])
    assert run.accuracy(label="x") == 0.75
    assert run.accuracy(depth_band=(0.0, 0.2), label="x") == 0.5
    assert run.accuracy(depth_band=(0.8, 1.0001), label="x") == 1.0
    assert run.accuracy(label="y") is None


def test_int8_configurations_build_quantized_models(tiny):
    """--kv-dtypes int8 reaches optimize: the model it builds holds int8 entries, the label says so."""
    import h2o_compile

    model, _ = tiny
    for config in (TaskConfig("full", kv_dtype="int8"), TaskConfig("h2o", 0.2, "snapkv", kv_dtype="int8")):
        opt = h2o_compile.optimize(model, compile=False, **config.optimize_kwargs())
        assert opt.h2o_config.kv_dtype == "int8" and config.label.endswith(" int8")
    plain = h2o_compile.optimize(model, compile=False, **TaskConfig("h2o", 0.2).optimize_kwargs())
    assert plain.h2o_config.kv_dtype != "int8" and not TaskConfig("h2o", 0.2).label.endswith("int8")
