"""Shared helpers of tests/deploy: the kustomize-rendered manifests, their pods and containers, and
the tools venv (scripts/install-checkov) that holds checkov and kubernetes-validate."""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENTS = REPO / "deployments"
ADDONS = REPO / "infra" / "cluster" / "addons"
TERRAFORM = REPO / "infra" / "terraform"
TOOLS_VENV = REPO / ".venv-tools"
IMAGE = "ghcr.io/joynexus/joynexus"  # CUDA: the Ray GPU workers
CPU_IMAGE = "ghcr.io/joynexus/joynexus-cpu"  # every other pod
WORKLOAD_KINDS = ("Deployment", "Job", "RayCluster")


@cache
def _render_text(folder: Path) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not on PATH")
    done = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def rendered_text(folder: Path = DEPLOYMENTS) -> str:
    return _render_text(folder)


def rendered(folder: Path = DEPLOYMENTS) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(_render_text(folder)) if doc]


def by_key(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def pod_specs(doc: dict) -> list[tuple[str, dict]]:
    """(label, pod spec) of every pod a workload makes (a RayCluster: its head and each worker group)."""
    name = f"{doc['kind']}/{doc['metadata']['name']}"
    if doc["kind"] == "RayCluster":
        spec = doc["spec"]
        pods = [(f"{name}/head", spec["headGroupSpec"]["template"])]
        pods += [(f"{name}/{g['groupName']}", g["template"]) for g in spec.get("workerGroupSpecs", [])]
        return [(label, template["spec"]) for label, template in pods]
    if doc["kind"] in ("Deployment", "Job"):
        return [(name, doc["spec"]["template"]["spec"])]
    return []


def tool(name: str, package: str | None = None) -> Path:
    path = TOOLS_VENV / "bin" / name
    if not path.exists():
        pytest.skip(f"{package or name} is not installed: run scripts/install-checkov (creates {TOOLS_VENV.name}/)")
    return path
