"""The one string syntax of a configuration and the presets' options, shared by Python, the CLI and result
files (config/presets.py builds the H2OConfig of each preset).

A rule string is parts joined by ``+``; each part is

- a preset name (:data:`PRESETS`): ``paper``, ``recommended``, ``tova``, ``snapkv``, ``sink``, ``local``, ...;
- a registered score name (kernels/rules.py): ``mean``, ``max``, ``knorm`` (= ``score=NAME``);
- ``name=value`` for any H2OConfig or ScoreRule field: ``budget=0.1``, ``recent_ratio=0.1``, ``decay=0.99``,
  ``prompt_window=64``, ``prompt_pool=21``, ``sliding_score=sum``, ``kv_dtype=int8``, ... (``none`` for None);
  ``allocation=prompt``, or a calibrated split as its per-layer shares joined by ``:``, a layer split between its
  KV heads as their shares joined by ``/`` (``allocation=0.5:1.5``, ``allocation=0.5/0.75:1.5``).
  Short names kept from earlier result files: ``window``, ``pool``, ``recent``, ``global``, ``sliding``, ``sinks``.

A field may be set once per string (``"tova+decay=0.9"`` is an error: tova already sets decay);
``H2OConfig.replace`` changes a preset's fields from Python.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..kernels.rules import SCORES

# name -> (options, what it is for). Options are flat H2OConfig / ScoreRule fields (H2OConfig.from_options).
_PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "paper": ({}, "H2O as published (Algorithm 1): accumulated attention, half the budget for recent tokens"),
    "recommended": (dict(recent_ratio=0.1, score="max", decay=0.99, prompt_window=64, prompt_pool=21),
                    "the best general setting measured: the decayed peak attention with SnapKV's prompt window"),
    "tova": (dict(decay=0.0), "TOVA: only the newest query's attention decides"),
    "snapkv": (dict(prompt_window=64, prompt_pool=5), "SnapKV: the prompt's last 64 queries score, pooled"),
    "knorm": (dict(score="knorm"), "KnormPress: keys with the smallest L2 norm stay; no attention read"),
    "sink": (dict(policy="sink"), "StreamingLLM: 4 attention sinks, then the most recent tokens"),
    "local": (dict(policy="local"), "the most recent tokens only"),
    "full": (dict(policy="full"), "no eviction: the full-cache baseline"),
}
PRESET_OPTIONS: dict[str, dict[str, Any]] = {name: options for name, (options, _) in _PRESETS.items()}
PRESET_NOTES: dict[str, str] = {name: note for name, (_, note) in _PRESETS.items()}

_ALIASES = {"window": "prompt_window", "pool": "prompt_pool", "recent": "recent_ratio", "global": "global_share",
            "sliding": "sliding_score", "sinks": "sink_tokens"}


def _field_types(config_class) -> dict[str, str]:
    """Every H2OConfig and ScoreRule field (the rule's fields side by side) -> its annotation."""
    rule_class = config_class.__dataclass_fields__["rule"].default_factory
    types = {f.name: str(f.type) for cls in (config_class, rule_class) for f in dataclasses.fields(cls)}
    types.pop("rule")
    return types


def _read(name: str, kind: str, text: str) -> Any:
    """``text`` as the value of field ``name`` (its annotation ``kind`` says which kind)."""
    if text.lower() == "none" and "Optional" in kind:
        return None
    if name == "budget":
        return int(text) if text.isdigit() else float(text)
    if name == "prefill":
        return text if text == "full" else int(text)
    if name == "allocation":  # a name, or a calibrated split: per layer one share, or its heads' joined by "/"
        if not any(c.isdigit() for c in text):  # a name ("uniform", "prompt-heads"); else shares, checked later
            return text
        return tuple(tuple(map(float, layer.split("/"))) if "/" in layer else float(layer) for layer in text.split(":"))
    if kind == "bool":
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(text)
        return text.lower() in ("true", "1")
    if "float" in kind:
        return float(text)
    if "int" in kind:
        return int(text)
    return text


def read_options(text: str, config_class) -> dict[str, Any]:
    """The rule string -> flat ``config_class`` (H2OConfig) / ScoreRule options (only what it sets). A ValueError
    names the part it cannot read or the field set twice; H2OConfig checks the values."""
    field_types = _field_types(config_class)
    if not isinstance(text, str) or not text:
        raise ValueError(f"rule string {text!r} is empty; use a preset ({', '.join(PRESET_OPTIONS)}) or options "
                         "such as max+decay=0.99")
    options: dict[str, Any] = {}
    for part in text.split("+"):
        name, _, value = part.partition("=")
        name = _ALIASES.get(name, name)
        try:
            if part in PRESET_OPTIONS:
                given = dict(PRESET_OPTIONS[part])
            elif part in SCORES:
                given = {"score": part}
            elif value and name in field_types:
                given = {name: _read(name, field_types[name], value)}
            elif value and name == "compression_ratio":  # kvpress's name: H2OConfig refuses it with the hint
                given = {name: float(value)}
            else:
                raise ValueError(part)
        except ValueError:
            raise ValueError(f"rule string {text!r}: cannot read {part!r}; use a preset ({', '.join(PRESET_OPTIONS)}),"
                             f" a score ({', '.join(SCORES)}) or name=value with a field of H2OConfig, joined by "
                             "'+'") from None
        twice = sorted(set(given) & set(options))
        if twice:  # e.g. "mean+max" or "tova+decay=0.9": the later part would silently win
            raise ValueError(f"rule string {text!r}: {part!r} sets {', '.join(twice)} a second time")
        options.update(given)
    return options


def format_options(config) -> str:
    """The shortest plain rule string of ``config``: its fields that differ from the defaults, "paper" if none."""
    default = type(config)(policy=config.policy)  # the policy's own default sinks are not a change
    parts = [f"policy={config.policy}"] * (config.policy != "h2o")
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name not in ("rule", "policy") and value != getattr(default, f.name):
            parts.append(f"{f.name}={_format_allocation(value) if isinstance(value, tuple) else value}")
    for f in dataclasses.fields(config.rule):
        if getattr(config.rule, f.name) != getattr(default.rule, f.name):
            parts.append(f"{f.name}={getattr(config.rule, f.name)}")
    return "+".join(parts) or "paper"


def _format_allocation(shares: tuple) -> str:
    """A calibrated split in the rule string's form: layers joined by ":", a layer's KV heads by "/"."""
    return ":".join("/".join(map(repr, entry)) if isinstance(entry, tuple) else repr(entry) for entry in shares)
