"""The package's import graph has no circles (counting imports inside functions and under TYPE_CHECKING: a circle
there is still two modules that cannot be read apart), and every module imports on its own, whatever was imported
before it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import specsample

ROOT = Path(specsample.__file__).parent
OPTIONAL = {"specsample.deploy": "ray"}  # modules that need an optional extra


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("specsample",) + path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports anywhere in its source (packages' __init__ only when imported as such)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_the_import_graph_has_no_circles() -> None:
    modules = _modules()
    # the package's __init__ re-exports the public API: it imports the package, nothing imports it back
    graph = {name: _imports(name, path, modules) - {"specsample"} for name, path in modules.items()}
    assert _cycles(graph) == []


def test_every_module_imports_on_its_own() -> None:
    """Each module imported first in a clean interpreter state (the package's modules dropped in between), in two
    interpreters at once, each taking every other module."""
    names = [n for n in sorted(_modules()) if not any(n.startswith(m) for m in OPTIONAL) or _has(OPTIONAL[n])]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _importer(names[half::2])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for half in (0, 1)
    ]
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]
        assert out.strip() == ""


def _importer(names: list[str]) -> str:
    """A script importing each of `names` with none of the package's modules loaded before it; it prints the
    failures."""
    return (
        "import importlib, sys\n"
        f"names = {names!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'specsample' or m.startswith('specsample.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
    )


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
