"""The capability table (h2o_compile/config/capabilities.py), the presets and the rule string
(h2o_compile/config/rule_string.py): every (backend, score) pair is served or refused by name, the entry points
check the table before any work, presets and strings round-trip. Whether a served pair computes the contract is
tested per backend against the float64 simulation (tests/kernels/test_score_rules.py) or the reference
(tests/export/, rules from the same table)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import h2o_compile
from h2o_compile import H2OConfig, PRESETS, ScoreRule
from h2o_compile.config import CAPABILITIES, capability_table, check_served
from h2o_compile.kernels.rules import SCORES
from h2o_compile.config import PRESET_NOTES, parse_options, preset_table

from .runtime.arch_configs import build


@pytest.mark.parametrize("backend", CAPABILITIES)
@pytest.mark.parametrize("score", SCORES)
def test_every_backend_serves_or_refuses_each_score_by_name(backend, score):
    config = H2OConfig(rule=ScoreRule(score=score))
    if CAPABILITIES[backend].serves_score(score):
        check_served(config, backend)
        assert backend in config.served_by
        return
    with pytest.raises(ValueError, match=f"score='{score}' is not served by the {backend} .*; served by: ") as err:
        check_served(config, backend)
    assert all(name in str(err.value) for name in config.served_by) and backend not in config.served_by


def test_prompt_options_are_refused_by_the_onnx_backends():
    config = PRESETS["snapkv"]
    for backend in ("ONNX function", "native ORT CPU", "native ORT CUDA"):
        with pytest.raises(ValueError, match=f"prompt_window=64 / prompt_pool=5 is not served by the {backend}"):
            check_served(config, backend)
    assert config.served_by == ["reference", "compiled CPU step", "native CPU ops", "Triton"]


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="backend='tpu'; known: reference"):
        check_served(H2OConfig(), "tpu")


@pytest.mark.parametrize("op", ["function", "native"])
def test_export_refuses_a_score_outside_its_backend_before_writing(tmp_path, op):
    with pytest.raises(ValueError, match="score='knorm' is not served by the (ONNX function|native ORT CPU)"):
        h2o_compile.export_onnx(build("llama"), tmp_path / "never", config="knorm", op=op)
    assert not (tmp_path / "never").exists()


def test_tables_list_every_backend_score_and_preset():
    table = capability_table()
    assert all(f"| {name} |" in table for name in CAPABILITIES) and all(f"score={s}" in table for s in SCORES)
    presets = preset_table()
    assert all(f"| `{name}` |" in presets for name in PRESETS) and set(PRESET_NOTES) == set(PRESETS)


# -- presets and the rule string ------------------------------------------------------------------------------


def test_presets_are_the_settings_they_name():
    assert PRESETS["paper"] == H2OConfig()
    assert PRESETS["recommended"].rule == ScoreRule(score="max", decay=0.99, prompt_window=64, prompt_pool=21)
    assert PRESETS["recommended"].recent_ratio == 0.1
    assert PRESETS["tova"].rule.decay == 0.0 and PRESETS["sink"].sink_tokens == 4
    assert PRESETS["snapkv"].rule == ScoreRule(prompt_window=64, prompt_pool=5)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_round_trips_through_string_and_dict(name):
    config = PRESETS[name]
    assert H2OConfig.parse(name) == config
    assert H2OConfig.parse(config.to_string()) == config
    assert H2OConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["version"] == 1


def test_a_rule_string_sets_config_and_rule_fields():
    config = H2OConfig.parse("recommended+budget=0.1+kv_dtype=int8")
    assert config == PRESETS["recommended"].replace(budget=0.1, kv_dtype="int8")
    assert H2OConfig.parse("max+window=64+pool=21+recent=0.1+decay=0.99") == PRESETS["recommended"]
    assert H2OConfig.parse("budget=16+prefill=8+sinks=2").budget == 16
    assert H2OConfig.parse("positions=capped+max_distance=none").max_distance is None


@pytest.mark.parametrize("text,match", [
    ("tova+decay=0.9", "'decay=0.9' sets decay a second time"),
    ("sink+local", "'local' sets policy a second time"),
    ("recommended+scor=max", "cannot read 'scor=max'"),
    ("", "is empty"),
    ("budget=abc", "cannot read 'budget=abc'"),
])
def test_bad_rule_strings_are_named(text, match):
    with pytest.raises(ValueError, match=match):
        parse_options(text)


def test_replace_reaches_into_the_rule_and_resets_policy_defaults():
    config = PRESETS["recommended"].replace(decay=0.9, budget=32)
    assert config.rule.decay == 0.9 and config.rule.score == "max" and config.budget == 32
    assert H2OConfig(policy="local").replace(policy="sink").sink_tokens == 4  # the new policy's own sinks
    with pytest.raises(TypeError, match="unknown option.*score_decay"):
        H2OConfig().replace(score_decay=0.5)


@pytest.mark.parametrize("make,match", [
    (lambda: H2OConfig().replace(score="tova"), "score='tova' .did you mean config='tova'"),
    (lambda: H2OConfig(policy="recommended"), "policy='recommended' is not supported .did you mean config="),
    (lambda: ScoreRule(score="knorm", decay=0.5), "score='knorm' takes no decay"),
    (lambda: ScoreRule(score="knorm", prompt_window=8), "prompt_window=8 .*score='knorm' reads no attention"),
    (lambda: H2OConfig(policy="sink", rule=ScoreRule(decay=0.5)), "decay=0.5: the score rule is an option of"),
    (lambda: H2OConfig(rule={"score": "max"}), "must be a ScoreRule"),
])
def test_bad_configs_are_named(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_from_dict_refuses_another_version_and_unknown_fields():
    data = H2OConfig().to_dict()
    with pytest.raises(ValueError, match="version 0; this library reads version 1"):
        H2OConfig.from_dict({**data, "version": 0})
    with pytest.raises(ValueError, match="not an H2OConfig dict"):
        H2OConfig.from_dict({**data, "colour": "red"})


def test_optimize_takes_a_config_a_preset_or_a_string_with_overrides():
    model = build("llama")
    by_name = h2o_compile.optimize(model, 0.5, config="recommended", compile=False)
    by_string = h2o_compile.optimize(model, config=PRESETS["recommended"].to_string() + "+budget=0.5",
                                     compile=False)
    by_object = h2o_compile.optimize(model, config=dataclasses.replace(PRESETS["recommended"], budget=0.5),
                                     compile=False)
    assert by_name.h2o_config == by_string.h2o_config == by_object.h2o_config
    ids = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    tokens = [opt.generate(ids, max_new_tokens=6, do_sample=False) for opt in (by_name, by_string, by_object)]
    assert torch.equal(tokens[0], tokens[1]) and torch.equal(tokens[0], tokens[2])
    with pytest.raises(TypeError, match="config=3 must be an H2OConfig, a preset name"):
        h2o_compile.optimize(model, config=3)
