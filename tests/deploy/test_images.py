"""Every image a pod names is one the deployment builds and can pull: deployments/ names only the
images scripts/build-images builds, Terraform creates an ECR repository for each of them, and the
manifests bootstrap-cluster applies (infra/scripts/render-deployment) point every pod at the
deployment's registry and tag. The add-ons run their projects' released images, pinned."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.deploy.render import ADDONS, DEPLOYMENTS, REPO, pod_specs, rendered

BUILD = REPO / "scripts" / "build-images"
RENDER = REPO / "infra" / "scripts" / "render-deployment"
BOOTSTRAP = REPO / "infra" / "scripts" / "bootstrap-cluster"
REGISTRY_TF = REPO / "infra" / "terraform" / "modules" / "eks-gpu" / "registry.tf"


def built_images() -> set[str]:
    """The image names scripts/build-images tags ("$REPO/<name>:$TAG")."""
    names = set(re.findall(r'-t "\$REPO/([a-z0-9-]+):\$TAG"', BUILD.read_text()))
    assert names, "scripts/build-images tags no image"
    return names


def default_repo() -> str:
    return re.search(r'REPO="\$\{JOYNEXUS_IMAGE_REPO:-([^}]+)\}"', BUILD.read_text()).group(1)


def images_of(docs: list[dict]) -> dict[str, str]:
    """pod label/container -> image, for every container and init container of every workload."""
    found = {}
    for doc in docs:
        for label, pod in pod_specs(doc):
            for container in pod.get("initContainers", []) + pod["containers"]:
                found[f"{label}/{container['name']}"] = container["image"]
    return found


def test_deployments_name_only_images_the_build_makes():
    images = images_of(rendered(DEPLOYMENTS))
    assert images
    built = {f"{default_repo()}/{name}" for name in built_images()}
    for where, image in images.items():
        name, _, tag = image.rpartition(":")
        assert name in built, (where, image)
        assert re.fullmatch(r"\d+\.\d+\.\d+", tag), (where, image)
    kustomization = yaml.safe_load((DEPLOYMENTS / "kustomization.yaml").read_text())
    assert {i["name"] for i in kustomization["images"]} == built  # one tag setting covers every pod


def test_terraform_creates_a_repository_for_every_built_image_and_bootstrap_fills_it():
    text = REGISTRY_TF.read_text()
    repos = set(re.findall(r'"([a-z0-9-]+)"', re.search(r"images = toset\(\[(.*?)\]\)", text).group(1)))
    assert repos == built_images()
    assert 'name                 = "${var.cluster_name}/${each.key}"' in text
    assert 'image_tag_mutability = "IMMUTABLE"' in text
    bootstrap = BOOTSTRAP.read_text()
    checked = set(re.search(r"for image in ([a-z0-9 -]+); do", bootstrap).group(1).split())
    assert checked == built_images()  # the tag is looked up in every repository before building
    assert 'REGISTRY="$(tf image_registry)"' in bootstrap
    assert 'JOYNEXUS_IMAGE_REPO="$REGISTRY" scripts/build-images "$TAG" --push' in bootstrap
    assert 'infra/scripts/render-deployment --registry "$REGISTRY" --image-tag "$TAG"' in bootstrap
    # the node role pulls from ECR
    assert '"AmazonEC2ContainerRegistryReadOnly"' in (REGISTRY_TF.parent / "iam.tf").read_text()


def test_bootstrap_points_every_pod_at_the_deployments_registry_and_tag():
    registry = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/prod"
    args = [str(RENDER), "--registry", registry, "--image-tag", "0.2.0", "--cluster", "prod", "--bucket", "b",
            "--region", "eu-west-1", "--gcs-redis", "rediss://r:6379", "--db-secret", "arn:x"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    images = images_of(docs)
    assert len(images) == len(images_of(rendered(DEPLOYMENTS)))
    expected = {f"{registry}/{name}:0.2.0" for name in built_images()}
    for where, image in images.items():
        assert image in expected, (where, image)
    assert set(images.values()) == expected  # both images are used
    assert "ghcr.io" not in done.stdout
    missing = subprocess.run([str(RENDER), "--registry", registry], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "required" in missing.stderr


def test_add_ons_run_pinned_released_images():
    for where, image in images_of(rendered(ADDONS)).items():
        name, _, tag = image.rpartition(":")
        assert name and not name.startswith(default_repo()), (where, image)
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), (where, image)  # a release, never latest


def test_a_skip_reason_that_names_an_image_tag_names_the_tag_the_pod_runs():
    """A checkov skip that says which tag is pinned must say the tag the container really runs (the
    cluster-autoscaler's named v1.33.0 beside a v1.35.0 image)."""
    checked = 0
    for doc in rendered(ADDONS) + rendered(DEPLOYMENTS):
        annotations = doc.get("metadata", {}).get("annotations", {}) or {}
        named = {m for v in annotations.values() for m in re.findall(r"pinned by tag (v?[\d.]*\d)", str(v))}
        if not named:
            continue
        tags = {image.rpartition(":")[2] for image in images_of([doc]).values()}
        assert named <= tags, (doc["metadata"]["name"], named, tags)
        checked += 1
    assert checked >= 1


def test_bootstrap_deletes_every_job_before_applying_so_a_rerun_is_not_refused():
    """A Job's template is immutable: re-applying one with a new image tag within its TTL fails, so
    bootstrap deletes each Job the manifests hold before it applies them (issue 43.6)."""
    jobs = {d["metadata"]["name"] for d in rendered(DEPLOYMENTS) if d["kind"] == "Job"}
    assert jobs
    bootstrap = BOOTSTRAP.read_text()
    deleted = re.search(r'kubectl -n "\$NS" delete job ([a-z0-9 -]+?) --ignore-not-found', bootstrap)
    assert deleted and set(deleted.group(1).split()) == jobs
    assert bootstrap.index(deleted.group(0)) < bootstrap.index("infra/scripts/render-deployment --registry")
