"""argparse types shared by the command modules (cli.py, quality/commands.py), which import this one and not
each other, and by the scripts under benchmarks/."""

from __future__ import annotations

import argparse


def csv_of(kind):
    """An argparse ``type`` for a comma-separated list: ``csv_of(float)("0.1,0.2")`` -> [0.1, 0.2]."""
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of {kind.__name__}") from None
    return parse
