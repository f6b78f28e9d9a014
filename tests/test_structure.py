"""The shape of the code a newcomer reads: no module-level import cycle,
no product file over 600 lines, no function over 80, one place that
assembles a site, and secure aggregation outside the site runner."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The product's folders and the package each is installed as.
PACKAGES = {"clinfed": "clinfed", "tasks": "clinfed.tasks", "privacy": "clinfed.privacy"}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the product ``name`` imports when it is imported (imports
    inside functions and under ``if TYPE_CHECKING`` run later, or never)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_level_import_cycle():
    modules = _modules()
    graph = {
        name: _module_level_imports(name, path, set(modules)) for name, path in modules.items()
    }
    assert graph["clinfed.pipeline"], "the import graph came out empty: the reader is broken"
    assert import_cycles(graph) == []


def test_no_product_file_over_600_lines_and_no_function_over_80():
    long_files, long_functions = [], []
    for path in _modules().values():
        text = path.read_text()
        if len(text.splitlines()) > 600:
            long_files.append(str(path.relative_to(ROOT)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                if node.end_lineno - first + 1 > 80:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert long_files == [] and long_functions == []


def test_one_place_builds_a_site_s_privacy_and_the_runner_knows_no_secure_aggregation():
    uses = {}
    for name, path in _modules().items():
        text = path.read_text()
        for word in ("SitePrivacy(", "SiteRunner(", "secure"):
            if word in text:
                uses.setdefault(word, set()).add(name)
    assert uses["SitePrivacy("] == {"clinfed.federated.assembly"}
    assert uses["SiteRunner("] == {"clinfed.federated.assembly"}
    assert "clinfed.federated.site" not in uses["secure"]
    assert "clinfed.flower.handler" not in uses["secure"]
