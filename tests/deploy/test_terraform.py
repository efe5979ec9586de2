"""infra/terraform: formatted, one file per concern, exact provider pins, ONLY the aws provider (so the
ROOT module validates offline against a mirror holding hashicorp/aws: `terraform init -backend=false
-plugin-dir <mirror>` + `terraform validate`), and the pieces a running deployment needs."""

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


def all_tf(folder: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(folder.rglob("*.tf")))


def run(args: list[str], cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_IN_AUTOMATION="1", TF_INPUT="0", CHECKPOINT_DISABLE="1")
    rc = tmp_path / "terraformrc"
    rc.write_text("")
    env["TF_CLI_CONFIG_FILE"] = str(rc)  # no user config: nothing but the mirror given here
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_layout_one_file_per_concern_only_the_aws_provider():
    assert {p.name for p in TERRAFORM.glob("*.tf")} == {
        "versions.tf", "providers.tf", "variables.tf", "main.tf", "outputs.tf",
    }  # fmt: skip
    assert {p.name for p in MODULE.glob("*.tf")} == {
        "versions.tf", "variables.tf", "network.tf", "iam.tf", "cluster.tf", "node_groups.tf", "storage.tf",
        "shared.tf", "database.tf", "kms.tf", "audit.tf", "cache.tf", "registry.tf", "outputs.tf",
    }  # fmt: skip
    for folder in (TERRAFORM, MODULE):
        assert required_providers(folder) == {"hashicorp/aws"}
        assert re.search(
            r'aws = \{\s*source\s*= "hashicorp/aws"\s*version = "\d+\.\d+\.\d+"', (folder / "versions.tf").read_text()
        )
    text = all_tf(TERRAFORM)
    assert "helm_release" not in text and 'provider "kubernetes"' not in text
    assert (TERRAFORM / "backend.tf.example").read_text().count('backend "s3"') == 1


def test_the_deployment_pieces_are_there():
    from tests.deploy.test_terraform_plan import newest_standard_support_version

    module = all_tf(MODULE)
    variables = (TERRAFORM / "variables.tf").read_text()
    default = re.search(r'kubernetes_version\s*= optional\(string, "(\d+\.\d+)"\)', variables).group(1)
    assert default == newest_standard_support_version()  # the module's own default agrees
    assert re.search(r"public_endpoint\s*= optional\(bool, false\)", variables)  # private unless asked
    assert "public_access_cidrs = var.public_endpoint ? var.public_access_cidrs : null" in module
    # RDS PostgreSQL, password generated and kept by RDS in Secrets Manager
    assert 'resource "aws_db_instance" "this"' in module and 'engine         = "postgres"' in module
    assert "manage_master_user_password   = true" in module and "publicly_accessible    = false" in module
    # per-pod IAM; the node role has no S3
    assert 'resource "aws_eks_pod_identity_association" "pod"' in module and "pods.eks.amazonaws.com" in module
    node_policies = re.search(r'resource "aws_iam_role_policy_attachment" "node" \{(.*?)\n\}', module, re.S).group(1)
    assert "S3" not in node_policies and not re.search(r"role\s*=\s*aws_iam_role\.node\.id", module)
    # add-ons: NetworkPolicy enforcement, EBS and EFS CSI
    assert "enableNetworkPolicy" in module
    for addon in ("aws-ebs-csi-driver", "aws-efs-csi-driver", "eks-pod-identity-agent"):
        assert f'addon_name                  = "{addon}"' in module, addon
    assert 'resource "aws_efs_file_system" "shared"' in module
    # S3 lifecycle of old checkpoints
    assert re.search(r'prefix = "checkpoints/"(.|\n)*?noncurrent_version_expiration', module)
    # node autoscaling: cluster-autoscaler permissions, desired_size left to it
    assert "autoscaling:SetDesiredCapacity" in module and "ignore_changes = [scaling_config[0].desired_size]" in module


def test_terraform_fmt(tmp_path):
    done = run([terraform_bin(), "fmt", "-check", "-recursive", "-diff", str(TERRAFORM)], REPO, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("folder", [TERRAFORM, MODULE], ids=["root", "eks-gpu"])
def test_module_validates_offline(folder, tmp_path):
    """`terraform init -backend=false -plugin-dir=<mirror>` + `terraform validate`, in a copy (init writes
    .terraform/ and a lock file next to the configuration). The root module included: it needs only aws."""
    terraform = terraform_bin()
    mirror = provider_mirror()
    if mirror is None:
        pytest.skip("no local provider mirror (a folder named registry.terraform.io) was found")
    assert required_providers(folder) <= mirrored_providers(mirror), f"the mirror at {mirror} lacks a provider"
    work = tmp_path / folder.name
    shutil.copytree(folder, work, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*", ".terraform.lock.hcl"))
    init = run([terraform, "init", "-backend=false", f"-plugin-dir={mirror}", "-input=false"], work, tmp_path)
    assert init.returncode == 0, init.stdout + init.stderr
    validate = run([terraform, "validate", "-no-color"], work, tmp_path)
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert "The configuration is valid" in validate.stdout
