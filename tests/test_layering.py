"""The package's layering, read from the source with ast (nothing is imported):

* the lower layers never import the Master, the tenant API, ops, the connect/client side or the CLI
  (imports inside functions count too);
* joynexus.protocol imports nothing of joynexus but itself;
* the module-level imports among joynexus modules form no cycle;
* nothing in joynexus imports the `recipes` package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import joynexus

PACKAGE_ROOT = Path(joynexus.__file__).resolve().parent

LOWER_LAYERS = (
    "joynexus.core",
    "joynexus.models",
    "joynexus.scheduling",
    "joynexus.services",
    "joynexus.envs",
    "joynexus.data",
    "joynexus.algorithms",
    "joynexus.artifacts",
    "joynexus.protocol",
    "joynexus.spec",
    "joynexus.schema",
    "joynexus.settings",
    "joynexus.actors",
)
UPPER_LAYERS = (
    "joynexus.master",
    "joynexus.api",
    "joynexus.ops",
    "joynexus.connect",
    "joynexus.client",
    "joynexus.cli",
)

# Known violations in the current tree, to be removed as they are fixed: (importer, imported).
ALLOWED_UPWARD: set[tuple[str, str]] = set()
ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom reads from (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not _is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in module `name`; `from x import y`
    with y a submodule of x counts as an import of x.y (not of x)."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    top_level = {id(node) for node in tree.body}
    # Imports under a module-level `if` / `try` run at import time too; those under
    # `if TYPE_CHECKING:` never run (no cycle) but still count as a layering dependency.
    for node in tree.body:
        if isinstance(node, ast.If | ast.Try):
            for child in ast.walk(node):
                if isinstance(child, ast.Import | ast.ImportFrom) and not _is_type_checking(node):
                    top_level.add(id(child))
    found: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, node.lineno, id(node) in top_level))
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(name, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule if submodule in MODULES else source, node.lineno, id(node) in top_level))
    return found


def _is_type_checking(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


IMPORTS = {name: _imports(name) for name in MODULES}


def _edges(*, top_level_only: bool) -> set[tuple[str, str]]:
    edges = set()
    for importer, found in IMPORTS.items():
        for imported, _line, top in found:
            if top_level_only and not top:
                continue
            if imported.split(".")[0] == "joynexus" and imported != importer:
                edges.add((importer, imported))
    return edges


def _where(importer: str, imported: str) -> str:
    lines = sorted({line for name, line, _ in IMPORTS[importer] if name == imported})
    return f"{importer} -> {imported} ({MODULES[importer].relative_to(PACKAGE_ROOT.parent)}:{lines})"


def test_modules_were_found():
    assert {"joynexus.spec", "joynexus.master.tenant_creator", "joynexus.protocol"} <= set(MODULES)


def test_lower_layers_never_import_the_upper_layers():
    bad = sorted(
        (importer, imported)
        for importer, imported in _edges(top_level_only=False)
        if _within(importer, LOWER_LAYERS) and _within(imported, UPPER_LAYERS)
    )
    unexpected = [edge for edge in bad if edge not in ALLOWED_UPWARD]
    assert not unexpected, "lower layer imports an upper one:\n  " + "\n  ".join(_where(*e) for e in unexpected)


def test_the_protocol_imports_nothing_of_joynexus_but_itself():
    bad = sorted(
        (importer, imported)
        for importer, imported in _edges(top_level_only=False)
        if _within(importer, ("joynexus.protocol",)) and not _within(imported, ("joynexus.protocol",))
    )
    assert not bad, "joynexus.protocol imports outside itself:\n  " + "\n  ".join(_where(*e) for e in bad)


def test_nothing_in_joynexus_imports_recipes():
    bad = sorted(
        (importer, imported, line)
        for importer, found in IMPORTS.items()
        for imported, line, _ in found
        if imported == "recipes" or imported.startswith("recipes.")
    )
    assert not bad, "joynexus imports recipes:\n  " + "\n  ".join(f"{a} -> {b} (line {n})" for a, b, n in bad)


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-loop), Tarjan's algorithm."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_module_level_imports_form_no_cycle():
    edges = {(a, b) for a, b in _edges(top_level_only=True) if b in MODULES and (a, b) not in ALLOWED_CYCLE_EDGES}
    cycles = _cycles(edges)
    lines = []
    for component in cycles:
        members = set(component)
        lines.append(" <-> ".join(component))
        lines.extend("    " + _where(a, b) for a, b in sorted(edges) if a in members and b in members)
    assert not cycles, "import cycles among joynexus modules:\n  " + "\n  ".join(lines)
