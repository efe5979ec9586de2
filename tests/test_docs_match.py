"""The docs and packaging say what the code does (issue 30): `flows` ships with the package, paths
the flows' docstrings name exist, every setting read from the environment is in the README, and
docs/architecture.md describes what an interrupted evaluation does."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent


def test_the_flows_package_is_installed_with_joynexus():
    # `python -m flows.tenant_lifecycle` from any directory needs `flows` in the distribution.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = set(find_packages(where=str(ROOT), include=config["include"]))
    assert {"joynexus", "flows"} <= packages
    assert not packages & {"tests", "recipes", "benchmarks"}  # and nothing that is not the library


def test_paths_named_in_the_flows_docstrings_exist():
    named = {
        path
        for source in (ROOT / "flows").glob("*.py")
        for path in re.findall(r"\b(examples/[\w./-]+\.(?:ya?ml|json|py))", source.read_text())
    }
    assert named, "the flows' docstrings name an example spec to run them with"
    assert not [p for p in named if not (ROOT / p).is_file()]


def test_the_readme_names_every_setting_read_from_the_environment():
    settings = (ROOT / "joynexus" / "settings.py").read_text()
    readme = (ROOT / "README.md").read_text()
    variables = set(re.findall(r'"(JOYNEXUS_[A-Z0-9_]+)"', settings))
    assert "JOYNEXUS_CHECKPOINT_KEEP_LAST" in variables
    assert not sorted(v for v in variables if v not in readme)


def test_architecture_says_an_interrupted_evaluation_runs_again():
    text = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    assert "an interrupted evaluation ends `failed`" not in text
    assert "an interrupted evaluation runs again" in text
    # ... which is what the Master does with an evaluation a dead Master left running
    assert "def rerun(" in (ROOT / "joynexus/master/workloads/evaluation.py").read_text()
