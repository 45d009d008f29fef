"""Where users already work: transformers' ``custom_generate`` (custom_generate.py)."""

from .custom_generate import CUSTOM_GENERATE

__all__ = ["CUSTOM_GENERATE"]
