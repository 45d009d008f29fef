"""The configuration, the leaf of the package: :class:`H2OConfig` (with its :class:`ScoreRule`), the rule-string
syntax, the named presets and what each backend serves."""

from .capabilities import CAPABILITIES, Capability, capability_table, check_served, served_by
from .h2o_config import OPTION_NAMES, POLICIES, POSITIONS, H2OConfig, ScoreRule
from .presets import PRESETS, parse_options, preset_table, resolve_config
from .rule_string import PRESET_NOTES, PRESET_OPTIONS, format_options

__all__ = ["CAPABILITIES", "Capability", "H2OConfig", "OPTION_NAMES", "POLICIES", "POSITIONS", "PRESETS",
           "PRESET_NOTES", "PRESET_OPTIONS", "ScoreRule", "capability_table", "check_served", "format_options",
           "parse_options", "preset_table", "resolve_config", "served_by"]
