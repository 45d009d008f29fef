"""Named presets (:data:`PRESETS`), each an H2OConfig built from its options in config/rule_string.py."""

from __future__ import annotations

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
