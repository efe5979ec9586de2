"""The package's layering, read from the source with ast (nothing is imported):

* every room (a top-level module or package of joynexus) sits on one floor of `FLOORS`, and no import
  climbs to a higher floor (imports inside functions and under TYPE_CHECKING count too);
* joynexus.protocol imports nothing of joynexus but itself;
* the imports among joynexus modules form no cycle, whether they run at import time or inside a
  function (only TYPE_CHECKING imports, which never run, are left out);
* nothing in joynexus imports the `recipes` package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import joynexus

PACKAGE_ROOT = Path(joynexus.__file__).resolve().parent

# Floors, lowest first; docs/architecture.md names the same ones. A room may import its own floor
# and the floors below it.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("joynexus.settings", "joynexus.schema", "joynexus.protocol", "joynexus.actors",
                    "joynexus.extensions")),
    ("models and simulators", ("joynexus.models", "joynexus.envs", "joynexus.algorithms")),
    ("tenants, data, artifacts", ("joynexus.spec", "joynexus.core", "joynexus.data", "joynexus.artifacts",
                                  "joynexus.registry")),
    ("scheduling", ("joynexus.scheduling",)),
    ("execution plane", ("joynexus.services",)),
    ("master", ("joynexus.master",)),
    ("access", ("joynexus.connect", "joynexus.ops", "joynexus.client", "joynexus.robot_client")),
    ("tenant API and CLI", ("joynexus.api", "joynexus.cli")),
)  # fmt: skip
LOWER_LAYERS = tuple(room for _, rooms in FLOORS[:6] for room in rooms)
UPPER_LAYERS = tuple(room for _, rooms in FLOORS[6:] for room in rooms)


def _floor(module: str) -> int | None:
    for level, (_, rooms) in enumerate(FLOORS):
        if _within(module, rooms):
            return level
    return None


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


def _type_checking_lines(name: str) -> set[int]:
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    return {
        child.lineno
        for node in ast.walk(tree)
        if _is_type_checking(node)
        for child in ast.walk(node)
        if isinstance(child, ast.Import | ast.ImportFrom)
    }


TYPE_CHECKING_LINES = {name: _type_checking_lines(name) for name in MODULES}


def _edges(*, top_level_only: bool, running_only: bool = False) -> set[tuple[str, str]]:
    """Import edges between joynexus modules; `running_only` leaves out TYPE_CHECKING imports."""
    edges = set()
    for importer, found in IMPORTS.items():
        for imported, line, top in found:
            if top_level_only and not top:
                continue
            if running_only and line in TYPE_CHECKING_LINES[importer]:
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


def test_every_room_is_on_a_floor():
    rooms = {".".join(name.split(".")[:2]) for name in MODULES if name != "joynexus"}
    assert not sorted(room for room in rooms if _floor(room) is None), "rooms missing from FLOORS"


def test_no_import_climbs_to_a_higher_floor():
    bad = sorted(
        (importer, imported)
        for importer, imported in _edges(top_level_only=False)
        if (low := _floor(importer)) is not None and (high := _floor(imported)) is not None and high > low
    )
    assert not bad, "imports that climb a floor:\n  " + "\n  ".join(
        f"{_where(a, b)}: {FLOORS[_floor(a)][0]} -> {FLOORS[_floor(b)][0]}" for a, b in bad
    )


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
    _assert_no_cycle(_edges(top_level_only=True))


def test_imports_inside_functions_form_no_cycle_either():
    _assert_no_cycle(_edges(top_level_only=False, running_only=True))


def _assert_no_cycle(all_edges: set[tuple[str, str]]) -> None:
    edges = {(a, b) for a, b in all_edges if b in MODULES and (a, b) not in ALLOWED_CYCLE_EDGES}
    cycles = _cycles(edges)
    lines = []
    for component in cycles:
        members = set(component)
        lines.append(" <-> ".join(component))
        lines.extend("    " + _where(a, b) for a, b in sorted(edges) if a in members and b in members)
    assert not cycles, "import cycles among joynexus modules:\n  " + "\n  ".join(lines)
