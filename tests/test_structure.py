"""The shape of the code a newcomer reads: layers imported only downward,
no import circle at any depth, no product file over 600 lines and no
function over 80, one place that assembles a site, and secure aggregation
outside the site runner."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The product's folders and the package each is installed as.
PACKAGES = {"clinfed": "clinfed", "tasks": "clinfed.tasks", "privacy": "clinfed.privacy"}
PACKAGE_NAMES: set[str] = set()  # the modules that are packages (their __init__)


def _modules() -> dict[str, Path]:
    found = {}
    PACKAGE_NAMES.clear()
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
            if path.name == "__init__.py":
                PACKAGE_NAMES.add(name.removesuffix(".__init__"))
    return found


def _imports(name: str, source: str, known: set[str]) -> set[str]:
    """Modules of the product that module ``name`` (whose text is
    ``source``) imports at any depth: at the top, inside functions and
    under ``if TYPE_CHECKING`` alike. A function-level import runs later,
    but a circle through it is still a circle a reader must untangle."""
    package = name if name in PACKAGE_NAMES else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
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


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path.read_text(), known) for name, path in modules.items()}


def test_no_import_circle_at_any_depth():
    graph = _graph()
    assert graph["clinfed.runners.pipeline"], "the import graph came out empty"
    assert import_cycles(graph) == []
    # A circle closed by an import inside a function is seen: models gets
    # one back to pipeline, which imports it at the top.
    assert "clinfed.modeling.models" in graph["clinfed.runners.pipeline"]
    added = "def f():\n    from clinfed.runners.pipeline import run_training\n"
    graph["clinfed.modeling.models"] |= _imports("clinfed.modeling.models", added, set(graph))
    cycles = import_cycles(graph)
    assert any({"clinfed.modeling.models", "clinfed.runners.pipeline"} <= set(c) for c in cycles)


# The layers, lowest first: a module imports its own layer and those below,
# never one above (at any depth: inside functions and TYPE_CHECKING too).
LAYERS = [
    "clinfed.privacy",  # the DP library: accountants, DP-SGD, ledger, the release door
    "clinfed.core",  # errors, events, run folders, scratch, devices, provenance
    "clinfed.modeling",  # models, families, adapters, the training loop
    "clinfed.lexicon",  # name lists
    "clinfed.tasks",  # formats, examples, metrics
    "clinfed.federated",  # rounds: server engine, site runner, strategies, secure sums
    "clinfed.settings",  # THE schema (it reads tasks' and strategies' options)
    "clinfed.reporting",  # a run folder verified and written up
    "clinfed.runners",  # whole jobs built from a RunConfig
    "clinfed.flower",  # the Flower transport
    "clinfed.commands",  # the command line
    "clinfed.api",  # the Python API
    "clinfed",  # the package's lazy front (clinfed/__init__.py)
]


def layer_of(module: str) -> int:
    for index, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return index
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} -> {other}"
        for module, imported in graph.items()
        for other in imported
        if layer_of(other) > layer_of(module)
    )


def test_every_module_imports_only_its_layer_and_those_below():
    graph = _graph()
    top_level = {name.split(".")[1] for name in graph if name.count(".") >= 1}
    # Every top-level part of clinfed is a layer (its name says which).
    assert top_level == {layer.split(".")[1] for layer in LAYERS if "." in layer}
    assert upward_imports(graph) == []
    # An import up the layers inside a function is seen.
    graph["clinfed.modeling.adapters"].add("clinfed.federated.engine")
    assert upward_imports(graph) == ["clinfed.modeling.adapters -> clinfed.federated.engine"]


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


def test_library_errors_name_settings_never_flags():
    # A library error names a setting (`max_grad_norm`); the command line
    # words it as a flag, the API keeps the keyword, a node config the key.
    from clinfed.core.errors import name_settings

    said = "`max_grad_norm` must be at most 1000; lower it or `target_epsilon`"
    assert name_settings(said, "flag").startswith("--max-grad-norm must")
    assert "--target-epsilon" in name_settings(said, "flag")
    assert name_settings(said, "keyword") == said.replace("`", "")
    assert name_settings(said, "key").startswith("max-grad-norm must")
    flags = []
    for name, path in _modules().items():
        if name.startswith("clinfed.commands"):
            continue  # the command line's own words
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Raise) and node.exc is not None:
                if "--" in (ast.get_source_segment(source, node.exc) or ""):
                    flags.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert flags == []
