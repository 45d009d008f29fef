"""Named presets (:data:`PRESETS`), each an H2OConfig built from its options in config/rule_string.py."""

from __future__ import annotations

from typing import Union

from .capabilities import served_by
from .h2o_config import H2OConfig
from .rule_string import PRESET_NOTES, PRESET_OPTIONS, read_options

PRESETS: dict[str, H2OConfig] = {name: H2OConfig.from_options(options) for name, options in PRESET_OPTIONS.items()}


def parse_options(text: str) -> dict:
    """The rule string -> the flat H2OConfig / ScoreRule options it sets (config/rule_string.py)."""
    return read_options(text, H2OConfig)


def preset_table() -> str:
    """The presets as Markdown: name, what it is for, its rule string, the backends that serve it."""
    rows = ["| preset | for | rule string | served by |", "|---|---|---|---|"]
    for name, config in PRESETS.items():
        rows.append(f"| `{name}` | {PRESET_NOTES[name]} | `{config.to_string()}` | {', '.join(served_by(config))} |")
    return "\n".join(rows)


def resolve_config(config: Union[H2OConfig, str, None], budget, options: dict) -> H2OConfig:
    """``config`` (an H2OConfig, a preset name or a rule string; None = the paper's) with ``budget`` and
    ``options`` applied."""
    if config is None:
        config = H2OConfig()
    elif isinstance(config, str):
        config = H2OConfig.parse(config)
    elif not isinstance(config, H2OConfig):
        raise TypeError(f"config={config!r} must be an H2OConfig, a preset name ({', '.join(PRESET_OPTIONS)}) or "
                        "a rule string such as 'max+decay=0.99'")
    if budget is not None:
        options = {"budget": budget, **options}
    return config.replace(**options) if options else config
