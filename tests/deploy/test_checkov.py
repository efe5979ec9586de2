"""checkov (3.3.30, from .venv-tools: scripts/install-checkov) on infra/terraform and on the rendered
manifests: no failed check, and every skip carries its reason next to the resource (a
`#checkov:skip=ID:reason` comment in Terraform, a `checkov.io/skipN: ID=reason` annotation)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.deploy.render import ADDONS, DEPLOYMENTS, TERRAFORM, rendered_text, tool


def checkov(args: list[str]) -> list[dict]:
    done = subprocess.run([str(tool("checkov")), *args, "--quiet", "--compact", "-o", "json", "--skip-download"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    reports = json.loads(done.stdout)
    return reports if isinstance(reports, list) else [reports]


def assert_clean(reports: list[dict]) -> None:
    assert reports and all(r["summary"]["parsing_errors"] == 0 for r in reports)
    failed = [
        (c["check_id"], c["resource"], c["file_path"]) for r in reports for c in r["results"].get("failed_checks", [])
    ]
    assert failed == []
    for report in reports:
        for check in report["results"].get("skipped_checks", []):
            reason = (check.get("check_result") or {}).get("suppress_comment", "")
            assert len(reason) > 20, f"{check['check_id']} on {check['resource']}: skipped without a reason"


def test_checkov_terraform():
    assert_clean(checkov(["-d", str(TERRAFORM), "--framework", "terraform"]))


@pytest.mark.parametrize("folder", [DEPLOYMENTS, ADDONS], ids=["deployments", "cluster-addons"])
def test_checkov_rendered_manifests(folder, tmp_path):
    (tmp_path / "rendered.yaml").write_text(rendered_text(folder))
    assert_clean(checkov(["-d", str(tmp_path), "--framework", "kubernetes"]))


def test_checkov_ray_cluster_pod_templates(tmp_path):
    """checkov's kubernetes checks do not look inside the RayCluster custom resource, where tenant code
    runs: each of its pod templates (head, worker groups) is scanned as the Pod KubeRay makes of it.
    Skip annotations go on the template's metadata, as on any pod."""
    import yaml

    from tests.deploy.render import rendered

    docs = rendered(DEPLOYMENTS)
    pods = [d for d in docs if d["kind"] == "NetworkPolicy"]  # the policies that select Ray pods
    for doc in docs:
        if doc["kind"] != "RayCluster":
            continue
        spec = doc["spec"]
        groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
        for name, group in groups:
            template = group["template"]
            metadata = dict(template.get("metadata", {}))
            metadata["name"] = f"{doc['metadata']['name']}-{name}"
            metadata["namespace"] = doc["metadata"].get("namespace", "default")
            kuberay_labels = {  # what KubeRay puts on the pods it creates
                "ray.io/cluster": doc["metadata"]["name"],
                "ray.io/node-type": "head" if name == "head" else "worker",
                "ray.io/group": "headgroup" if name == "head" else name,
            }
            metadata["labels"] = {**metadata.get("labels", {}), **kuberay_labels}
            pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]})
    assert sum(p["kind"] == "Pod" for p in pods) >= 2
    (tmp_path / "raycluster-pods.yaml").write_text(yaml.safe_dump_all(pods))
    assert_clean(checkov(["-d", str(tmp_path), "--framework", "kubernetes"]))
