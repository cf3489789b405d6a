"""The package structure: dependencies point one way, no import circles, and `convert` needs neither torch nor jax.

cli.py -> parity_tests -> needle_flax, needle_torch -> convert (LAYOUT.md). Read from the source
with `ast`, every import counts, module level or inside a function.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"convert": 0, "needle_flax": 1, "needle_torch": 1, "parity_tests": 2, "cli": 3}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    files = [ROOT / "cli.py", *(p for pkg in LAYERS if pkg != "cli" for p in (ROOT / pkg).rglob("*.py"))]
    return {_module_name(p): p for p in files if not p.name.startswith("test_") and p.name != "conftest.py"}


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Our modules that `name` imports: `from a.b import c` is a.b.c when that is a module, else a.b."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}:{node.lineno}: relative import; the project imports absolutely"
            for a in node.names:
                out.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module)
    return {m for m in out if m.split(".")[0] in LAYERS and m in MODULES}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_every_arrow_points_down():
    """A module imports its own package or a lower layer; the two twins never import each other."""
    wrong = []
    for name, deps in GRAPH.items():
        mine = name.split(".")[0]
        for dep in deps:
            theirs = dep.split(".")[0]
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(f"{name} -> {dep}")
    assert wrong == [], "imports that run up or across the layers: " + ", ".join(sorted(wrong))


def test_no_import_circles():
    """Tarjan's strongly connected components of the module graph: every one is a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(GRAPH)))
    for v in GRAPH:
        if v not in index:
            visit(v)
    assert circles == []


def test_the_graph_is_read():
    """The checks above could pass on an empty or wrong graph: it must hold the known arrows."""
    assert {"convert.plan", "convert.registry"} <= GRAPH["convert.io"]
    assert "convert.mapping" in GRAPH["needle_torch.pretrained"]
    assert "parity_tests.families" in GRAPH["parity_tests.engine"]
    assert len(MODULES) > 40


def test_library_code_imports_our_modules_at_the_top():
    """Function-local imports of our own modules hide the layers; only cli.py defers its heavy commands (torch and
    jax load only for parity and generate)."""
    local = []
    for name, path in MODULES.items():
        if name == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    mod = sub.module if isinstance(sub, ast.ImportFrom) else None
                    names = [a.name for a in sub.names] if isinstance(sub, ast.Import) else [mod or ""]
                    if isinstance(sub, (ast.Import, ast.ImportFrom)) and any(
                            n.split(".")[0] in LAYERS for n in names):
                        local.append(f"{name}:{sub.lineno}")
    assert local == []


BLOCK = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "jax", "jaxlib", "flax", "orbax"):
            raise ImportError(f"{name} is blocked: convert must not need it")
sys.meta_path.insert(0, Block())
import convert
for m in pkgutil.walk_packages(convert.__path__, "convert."):
    importlib.import_module(m.name)
print("ok", len(list(pkgutil.walk_packages(convert.__path__, "convert."))))
"""


def test_every_convert_module_imports_without_torch_or_jax():
    result = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ") and int(result.stdout.split()[1]) > 20


@pytest.mark.parametrize("statement", ["import convert", "from convert.io import read_checkpoint"])
def test_convert_reads_a_checkpoint_without_torch_or_jax(statement):
    code = BLOCK.split("import convert")[0] + statement + (
        "\nfrom convert.io import read_checkpoint\n"
        f"c = read_checkpoint({str(ROOT / 'tests/data/needle-v2-tiny.pkl')!r}); print(c.family.name)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "v2", result.stderr
