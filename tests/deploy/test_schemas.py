"""Every rendered manifest (deployments/ and infra/cluster/addons/) validates against the Kubernetes
OpenAPI schemas (kubernetes-validate, strict: unknown fields are errors, as kubectl's server-side
field validation) and the RayCluster against the vendored KubeRay CRD schema, its pod templates
against the Kubernetes PodTemplateSpec. The validator runs in whichever environment has
kubernetes-validate: the project's, else .venv-tools (scripts/install-checkov)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.render import ADDONS, DEPLOYMENTS, rendered_text, tool

KUBERNETES_VERSION = "1.35"  # infra/terraform variables.tf default (eks-versions.json)
VALIDATOR = Path(__file__).resolve().parent / "k8s_validate.py"


def python_with_kubernetes_validate() -> str:
    if importlib.util.find_spec("kubernetes_validate") is not None:
        return sys.executable
    return str(tool("python", "kubernetes-validate"))


def validate(text: str) -> list[str]:
    done = subprocess.run([python_with_kubernetes_validate(), str(VALIDATOR), KUBERNETES_VERSION], input=text,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("folder", [DEPLOYMENTS, ADDONS], ids=["deployments", "cluster-addons"])
def test_rendered_manifests_validate(folder):
    assert validate(rendered_text(folder)) == []


def test_the_validator_catches_wrong_fields_in_crds_and_pod_templates():
    text = rendered_text(DEPLOYMENTS)
    broken = text.replace("minReplicas:", "minReplica:").replace(
        "readOnlyRootFilesystem: true", "readOnlyRootFilesystem: 1"
    )
    errors = validate(broken)
    assert any("RayCluster/joynexus" in e and "minReplica" in e for e in errors)
    assert any("RayCluster/joynexus" in e and "headGroupSpec.template" in e for e in errors)
    assert any(e.startswith("Deployment/joynexus-api") for e in errors)
