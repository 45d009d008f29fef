"""The package's layers: every import of a module of the package (at module level or inside a function) goes
against no layer's direction and closes no circle, so the tree reads as the data path (docs/design.md
section 3)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "h2o_compile"

# Each unit may import its own modules and the units of lower rank; equal ranks do not import each other.
RANKS = {"kernels": 0, "reporting": 0, "zoo": 0, "config": 1, "ops": 2, "graph": 3, "runtime": 4, "export": 5,
         "bench": 6, "quality": 6, "integrations": 6, "cli": 7, "": 8}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("h2o_compile",) + path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its code (a name imported from a package counts as that
    package's submodule when there is one)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_unit_has_a_rank(graph):
    assert {_unit(m) for m in graph} <= set(RANKS), "a new top-level module or package needs its rank in RANKS"


def test_imports_follow_the_layers(graph):
    against = [f"{src} -> {dst}" for src, targets in graph.items() for dst in targets
               if _unit(src) != _unit(dst) and RANKS[_unit(src)] <= RANKS[_unit(dst)]]
    assert not against, "imports against the layers' direction:\n" + "\n".join(sorted(against))


def test_no_import_circle(graph):
    # Tarjan's strongly connected components: any with two modules or more is a circle.
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


def test_the_checks_can_fail(tmp_path):
    """The walker sees a function-level import and a circle (a planted pair of modules)."""
    cyclic = {"h2o_compile.config.a": {"h2o_compile.runtime.b"}, "h2o_compile.runtime.b": {"h2o_compile.config.a"}}
    source = "def f():\n    from ..runtime import model\n"
    tree_modules = {"h2o_compile.config.x": None, "h2o_compile.runtime.model": None, "h2o_compile.runtime": None}
    path = tmp_path / "x.py"
    path.write_text(source)
    found = _imports("h2o_compile.config.x", path, tree_modules)
    assert found == {"h2o_compile.runtime.model"}
    with pytest.raises(AssertionError, match="import circles"):
        test_no_import_circle(cyclic)
    with pytest.raises(AssertionError, match="against the layers"):
        test_imports_follow_the_layers(cyclic)


def test_importing_the_package_loads_neither_dynamo_nor_triton():
    """Triton reads TRITON_INTERPRET when triton.language is first imported (tests/kernels/conftest.py sets it):
    ``import h2o_compile`` must not import it, nor torch._dynamo, which imports it."""
    code = ("import sys, h2o_compile, h2o_compile.cli, h2o_compile.bench.serve_continuous; "
            "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
