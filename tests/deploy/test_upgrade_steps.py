"""Issue 43.6, offline: the pieces of an upgrade that live outside the code agree. render-deployment
writes the release (the image tag) into the shared ConfigMap and into the Ray pods' and the services
Job's own templates (a restarted container of an old pod re-reads the ConfigMap, not its image);
bootstrap-cluster compares the Ray pods' image before it applies, waits for the line the services
driver logs once the old actors are gone (`ops.upgrade.OLD_ACTORS_GONE`), only then deletes the Ray
pods by KubeRay's cluster label, and waits for the services Job."""

from __future__ import annotations

import subprocess

import yaml

from joynexus.ops.upgrade import OLD_ACTORS_GONE
from tests.deploy.render import DEPLOYMENTS, REPO, by_key, rendered

BOOTSTRAP = REPO / "infra" / "scripts" / "bootstrap-cluster"
RENDER = REPO / "infra" / "scripts" / "render-deployment"


def _container_env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_render_deployment_writes_the_release_into_the_config_and_the_templates_that_compare_it():
    args = [str(RENDER), "--registry", "r.example/x", "--image-tag", "0.2.0", "--cluster", "prod", "--bucket", "b",
            "--region", "eu-west-1", "--gcs-redis", "rediss://r:6379", "--db-secret", "arn:x"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(done.stdout) if d}
    assert docs[("ConfigMap", "joynexus-config")]["data"]["JOYNEXUS_RELEASE"] == "0.2.0"
    cluster = docs[("RayCluster", "joynexus")]["spec"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    templates.append(docs[("Job", "joynexus-services")]["spec"]["template"])
    for template in templates:
        container = template["spec"]["containers"][0]
        assert _container_env(container)["JOYNEXUS_RELEASE"] == "0.2.0", container["name"]
        assert container["image"].endswith(":0.2.0"), container["name"]
    # the plain manifests (`kubectl apply -k deployments`) name the release of their image tag
    base = by_key(rendered(DEPLOYMENTS))
    tag = base[("RayCluster", "joynexus")]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    assert base[("ConfigMap", "joynexus-config")]["data"]["JOYNEXUS_RELEASE"] == tag.rpartition(":")[2]


def test_bootstrap_deletes_the_ray_pods_only_after_the_services_job_drained_the_old_release():
    text = BOOTSTRAP.read_text()
    before = text.index('old_image="$(kubectl -n "$NS" get raycluster joynexus')
    applied = text.index("infra/scripts/render-deployment --registry")
    waited = text.index(f'grep -qF "{OLD_ACTORS_GONE}"')
    deleted = text.index('kubectl -n "$NS" delete pod -l ray.io/cluster=joynexus')
    completed = text.index('kubectl -n "$NS" wait --for=condition=complete job/joynexus-services')
    assert before < applied < waited < deleted < completed
    assert 'if [ -n "$old_image" ] && [ "$old_image" != "$new_image" ]; then' in text
