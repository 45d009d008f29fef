"""Write docs/api.md, the API reference a reader can open without building anything, from the docstrings.

    python docs/api_reference.py           # rewrite docs/api.md
    python docs/api_reference.py --check   # exit 1 when docs/api.md is not what the code says today (a test runs it)

``make docs`` builds the browsable HTML reference of the same docstrings with pdoc.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import h2o_compile
from h2o_compile import config as config_module

OUT = Path(__file__).resolve().parent / "api.md"
CLASSES = ("H2OModel", "H2OConfig", "ScoreRule", "H2OOrtModel")
CONFIG_FUNCTIONS = ("preset_table", "capability_table", "check_served", "served_by", "parse_options")


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def _doc(obj) -> str:
    text = inspect.getdoc(obj) or ""
    return f"```text\n{text}\n```\n" if text else ""


def _members(cls) -> list[str]:
    parts = []
    for name, member in vars(cls).items():
        if name.startswith("_") or not (callable(member) or isinstance(member, (property, classmethod,
                                                                                   staticmethod))):
            continue
        target = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        signature = "" if isinstance(member, property) else _signature(target)
        first = (inspect.getdoc(target) or "").split("\n\n")[0].replace("\n", " ")
        parts.append(f"- `{name}{signature}`" + (f": {first}" if first else ""))
    return parts


def render() -> str:
    lines = ["# API reference", "",
             "Written by `python docs/api_reference.py` from the docstrings (a test checks it is current); "
             "`make docs` builds the same as browsable HTML with pdoc. The public names are `h2o_compile.__all__`.",
             ""]
    for name in h2o_compile.__all__:
        obj = getattr(h2o_compile, name)
        lines.append(f"## `h2o_compile.{name}`")
        lines.append("")
        if name == "PRESETS":
            lines += ["A dict of preset name -> H2OConfig: " + ", ".join(f"`{key}`" for key in obj) + ".", ""]
            continue
        if isinstance(obj, str):
            lines += ["A path (str): the folder transformers' `custom_generate=` loads `custom_generate/generate.py` "
                      "from (h2o_compile/integrations/custom_generate.py).", ""]
            continue
        if inspect.ismodule(obj):
            lines += [_doc(obj), "Functions: " + ", ".join(f"`{n}`" for n in getattr(obj, "__all__", [])) + ".", ""]
            continue
        lines += [f"`{name}{_signature(obj)}`", "", _doc(obj)]
        if name in CLASSES:
            lines += ["Members:", "", *_members(obj), ""]
    lines += ["## `h2o_compile.config`", "", _doc(config_module)]
    for name in CONFIG_FUNCTIONS:
        obj = getattr(config_module, name)
        lines += [f"### `h2o_compile.config.{name}{_signature(obj)}`", "", _doc(obj)]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is not current: run python docs/api_reference.py")
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
