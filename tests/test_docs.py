"""The documentation: the README's size and quick start, links that resolve, the API reference build, docs/ size."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import h2o_compile

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "docs" / "results" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link's text stays, its URL goes
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")}


def test_readme_fits_in_a_few_screens_and_names_the_recommended_preset_early():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"
    assert "recommended" in "\n".join(lines[:50])
    assert "make test" in "\n".join(lines), "CI (.ci/run) runs the README's test command, make test"


def _broken_links(doc: Path) -> list[str]:
    broken = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    return broken


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    assert doc.is_file(), f"{doc.relative_to(ROOT)} is missing"
    assert not _broken_links(doc), f"{doc.relative_to(ROOT)}: links that do not resolve: {_broken_links(doc)}"


def test_every_result_file_link_resolves():
    """The result files cite each other, their plots and their commands: a pruned file must not leave a hole."""
    broken = {str(doc.relative_to(ROOT)): links for doc in sorted((ROOT / "docs" / "results").rglob("*.md"))
              if (links := _broken_links(doc))}
    assert not broken, f"links that do not resolve: {broken}"


def test_the_code_cites_the_design_document_in_the_repository():
    assert (ROOT / "docs" / "design.md").is_file()
    stale = [str(p.relative_to(ROOT)) for folder in ("h2o_compile", "tests", "benchmarks") for p in
             (ROOT / folder).rglob("*.py") if re.search("DESIGN(.md)? section", p.read_text(encoding="utf-8"))
             and p.name != "test_docs.py"]
    assert not stale, f"cite docs/design.md, not DESIGN.md / DESIGN: {stale}"


def test_the_license_file_matches_the_package_metadata():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'license = "Apache-2.0"' in pyproject
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")[:200]


def test_docs_folder_stays_under_10_mb():
    size = sum(p.stat().st_size for p in (ROOT / "docs").rglob("*") if p.is_file())
    assert size < 10 * 2**20, f"docs/ holds {size / 2**20:.1f} MiB"


def test_every_public_name_has_a_docstring():
    missing = [name for name in h2o_compile.__all__ if name != "PRESETS"
               and not inspect.getdoc(getattr(h2o_compile, name))]
    assert not missing, f"public names without a docstring: {missing}"
    for cls in (h2o_compile.H2OModel, h2o_compile.H2OConfig):
        bare = [name for name, member in vars(cls).items() if not name.startswith("_") and callable(member)
                and not inspect.getdoc(member)]
        assert not bare, f"{cls.__name__} methods without a docstring: {bare}"


def test_the_api_reference_builds(tmp_path):
    pytest.importorskip("pdoc")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    names = re.search(r"^API_MODULES := ((?:.*\\\n)*.*)$", makefile, re.M).group(1).replace("\\", " ").split()
    assert "h2o_compile" in names
    done = subprocess.run([sys.executable, "-m", "pdoc", "-o", str(tmp_path), *names], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "h2o_compile.html").read_text(encoding="utf-8")
    assert "optimize" in page and "H2OConfig" in page
    assert (tmp_path / "h2o_compile" / "config" / "presets.html").is_file()


def test_the_readme_quick_start_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    code = re.search(r"## Quick start\n\n```python\n(.*?)```", readme, re.S).group(1)
    assert 'config="recommended"' in code
    script = tmp_path / "quick_start.py"
    script.write_text(code, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bytes of KV cache" in done.stdout
