"""Size guards on the package, read with ast: no module of joynexus over MAX_MODULE_LINES lines and no
function over MAX_FUNCTION_LINES (signature, docstring and body). A hub that outgrows them is a room
doing several jobs; split it by concern rather than raising the bound. An exception is named here with
its reason, so it is a decision, not drift."""

from __future__ import annotations

import ast
from pathlib import Path

import joynexus

PACKAGE_ROOT = Path(joynexus.__file__).resolve().parent
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80

# "path relative to joynexus/" -> why it may be longer (none today).
MODULE_EXCEPTIONS: dict[str, str] = {}
# "path:function" -> why it may be longer (none today).
FUNCTION_EXCEPTIONS: dict[str, str] = {}

SOURCES = sorted(PACKAGE_ROOT.rglob("*.py"))


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE_ROOT).as_posix()


def test_no_module_is_over_the_bound():
    over = {
        _relative(path): lines
        for path in SOURCES
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES and _relative(path) not in MODULE_EXCEPTIONS
    }
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_function_is_over_the_bound():
    over = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                where = f"{_relative(path)}:{node.name}"
                if lines > MAX_FUNCTION_LINES and where not in FUNCTION_EXCEPTIONS:
                    over[f"{where} (line {node.lineno})"] = lines
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"


def test_the_exceptions_are_still_needed():
    # A named exception that no longer applies goes, so the list stays true.
    modules = {_relative(path): len(path.read_text().splitlines()) for path in SOURCES}
    stale = [name for name in MODULE_EXCEPTIONS if modules.get(name, 0) <= MAX_MODULE_LINES]
    assert not stale, f"module exceptions no longer needed: {stale}"
