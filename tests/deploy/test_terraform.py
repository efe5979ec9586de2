"""infra/terraform: formatted, one file per concern, pinned chart and provider versions, and
validated offline where the local provider mirror allows (it holds hashicorp/aws only)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TERRAFORM = REPO / "infra" / "terraform"
MODULE = TERRAFORM / "modules" / "eks-gpu"


def terraform_bin() -> str:
    path = shutil.which("terraform")
    if path is None:
        pytest.skip("terraform is not on PATH")
    return path


def provider_mirror() -> Path | None:
    """The parent of the folder named registry.terraform.io near / (STACK.md), or $JOYNEXUS_TF_PLUGIN_DIR."""
    if os.environ.get("JOYNEXUS_TF_PLUGIN_DIR"):
        return Path(os.environ["JOYNEXUS_TF_PLUGIN_DIR"])
    for root in (Path("/opt"), Path("/usr/local/share"), Path("/usr/share"), Path.home() / ".terraform.d", Path("/")):
        for depth in ("*", "*/*"):
            for found in root.glob(f"{depth}/registry.terraform.io"):
                if found.is_dir():
                    return found.parent
    return None


def mirrored_providers(mirror: Path) -> set[str]:
    return {f"{p.parent.name}/{p.name}" for p in (mirror / "registry.terraform.io").glob("*/*")}


def required_providers(folder: Path) -> set[str]:
    text = (folder / "versions.tf").read_text()
    return set(re.findall(r'source\s*=\s*"([a-z0-9-]+/[a-z0-9-]+)"', text))


def run(args: list[str], cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_IN_AUTOMATION="1", TF_INPUT="0", CHECKPOINT_DISABLE="1")
    rc = tmp_path / "terraformrc"
    rc.write_text("")
    env["TF_CLI_CONFIG_FILE"] = str(rc)  # no user config: nothing but the mirror given here
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_layout_one_file_per_concern_with_pinned_versions():
    assert {p.name for p in TERRAFORM.glob("*.tf")} == {
        "versions.tf", "providers.tf", "variables.tf", "main.tf", "kuberay.tf", "gpu.tf", "outputs.tf",
    }  # fmt: skip
    assert {p.name for p in MODULE.glob("*.tf")} == {
        "versions.tf", "variables.tf", "network.tf", "iam.tf", "cluster.tf", "node_groups.tf", "storage.tf",
        "outputs.tf",
    }  # fmt: skip
    versions = (TERRAFORM / "versions.tf").read_text()
    for provider in ("aws", "kubernetes", "helm"):  # exact pins, no ranges
        assert re.search(rf'{provider} = \{{\s*source\s*= "hashicorp/{provider}"\s*version = "\d+\.\d+\.\d+"', versions)
    variables = (TERRAFORM / "variables.tf").read_text()
    assert 'chart_version = optional(string, "1.4.2")' in variables  # KubeRay operator chart
    assert "optional(" in (MODULE / "variables.tf").read_text()
    kuberay = (TERRAFORM / "kuberay.tf").read_text()
    assert 'resource "helm_release" "kuberay_operator"' in kuberay
    assert "version          = var.kuberay.chart_version" in kuberay
    assert 'chart            = "kuberay-operator"' in kuberay


def test_terraform_fmt(tmp_path):
    done = run([terraform_bin(), "fmt", "-check", "-recursive", "-diff", str(TERRAFORM)], REPO, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_aws_module_validates_offline(tmp_path):
    """`terraform init -backend=false -plugin-dir=<mirror>` + `terraform validate` on the AWS module,
    in a copy (init writes .terraform/ and a lock file next to the configuration)."""
    terraform = terraform_bin()
    mirror = provider_mirror()
    if mirror is None:
        pytest.skip("no local provider mirror (a folder named registry.terraform.io) was found")
    missing = required_providers(MODULE) - mirrored_providers(mirror)
    if missing:
        pytest.skip(f"providers {sorted(missing)} are not in the mirror at {mirror}")
    work = tmp_path / "eks-gpu"
    shutil.copytree(MODULE, work)
    init = run([terraform, "init", "-backend=false", f"-plugin-dir={mirror}", "-input=false"], work, tmp_path)
    assert init.returncode == 0, init.stdout + init.stderr
    validate = run([terraform, "validate", "-no-color"], work, tmp_path)
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert "The configuration is valid" in validate.stdout


def test_root_module_validates_offline(tmp_path):
    terraform = terraform_bin()
    mirror = provider_mirror()
    if mirror is None:
        pytest.skip("no local provider mirror (a folder named registry.terraform.io) was found")
    missing = required_providers(TERRAFORM) - mirrored_providers(mirror)
    if missing:
        pytest.skip(
            f"the root module also needs {sorted(missing)} (helm_release for KubeRay, the cluster's "
            f"kubernetes provider), and the offline mirror at {mirror} holds only "
            f"{sorted(mirrored_providers(mirror))}; its AWS module is validated by test_aws_module_validates_offline"
        )
    work = tmp_path / "terraform"
    shutil.copytree(TERRAFORM, work)
    init = run([terraform, "init", "-backend=false", f"-plugin-dir={mirror}", "-input=false"], work, tmp_path)
    assert init.returncode == 0, init.stdout + init.stderr
    validate = run([terraform, "validate", "-no-color"], work, tmp_path)
    assert validate.returncode == 0, validate.stdout + validate.stderr
