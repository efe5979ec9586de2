"""Apply-time blockers caught offline: `terraform test` with a mocked aws provider plans the module's
defaults and its refusals (modules/eks-gpu/tests/plan.tftest.hcl); the Kubernetes version is checked
against the dated EKS support table; the key that encrypts node volumes grants the Auto Scaling
service-linked role (without it managed node groups never launch)."""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil

import pytest

from tests.deploy.test_terraform import MODULE, TERRAFORM, provider_mirror, run, terraform_bin

SUPPORT_TABLE = MODULE / "eks-versions.json"


def support_table() -> dict:
    return json.loads(SUPPORT_TABLE.read_text())


def day(text: str) -> dt.date:
    return dt.date.fromisoformat(text)


def newest_standard_support_version() -> str:
    table = support_table()
    as_of = day(table["as_of"])
    current = [v for v, d in table["versions"].items() if day(d["standard_support_ends"]) > as_of]
    return max(current, key=lambda v: tuple(int(x) for x in v.split(".")))


def test_terraform_test_plans_the_defaults_and_the_refusals_with_a_mocked_aws(tmp_path):
    terraform = terraform_bin()
    mirror = provider_mirror()
    if mirror is None:
        pytest.skip("no local provider mirror (a folder named registry.terraform.io) was found")
    work = tmp_path / "eks-gpu"
    shutil.copytree(MODULE, work, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*", ".terraform.lock.hcl"))
    init = run([terraform, "init", "-backend=false", f"-plugin-dir={mirror}", "-input=false"], work, tmp_path)
    assert init.returncode == 0, init.stdout + init.stderr
    # second_apply.tftest.hcl runs in its own test below (once per suite, not twice)
    done = run([terraform, "test", "-no-color", "-filter=tests/plan.tftest.hcl"], work, tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert re.search(r"Success! [1-9]\d* passed, 0 failed", done.stdout), done.stdout[-2000:]


def test_a_second_apply_changes_nothing(tmp_path):
    """modules/eks-gpu/tests/second_apply.tftest.hcl applies the module, then plans and applies again as
    the account answers after the first apply (the service-linked role now exists, tagged by this
    deployment). Each plan after an apply must read "No changes": a plan that destroys or replaces what
    the first apply made fails the second `terraform apply` (the node groups launch with that role)."""
    terraform = terraform_bin()
    mirror = provider_mirror()
    if mirror is None:
        pytest.skip("no local provider mirror (a folder named registry.terraform.io) was found")
    work = tmp_path / "eks-gpu"
    shutil.copytree(MODULE, work, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*", ".terraform.lock.hcl"))
    init = run([terraform, "init", "-backend=false", f"-plugin-dir={mirror}", "-input=false"], work, tmp_path)
    assert init.returncode == 0, init.stdout + init.stderr
    done = run([terraform, "test", "-no-color", "-verbose", "-filter=tests/second_apply.tftest.hcl"], work, tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # -verbose prints each run's plan (or, for an apply, its state) after the run's line
    runs = re.split(r'^  run "([a-z_]+)"\.\.\. (\w+)$', done.stdout, flags=re.M)
    sections = {runs[i]: (runs[i + 1], runs[i + 2]) for i in range(1, len(runs) - 2, 3)}
    source = (MODULE / "tests" / "second_apply.tftest.hcl").read_text()
    kinds = dict(re.findall(r'run "([a-z_]+)" \{\s*command = (plan|apply)', source))
    assert list(kinds.values())[0] == "apply" and "plan" in list(kinds.values())[1:], kinds
    for name, kind in kinds.items():
        outcome, body = sections[name]
        assert outcome == "pass", (name, body[-2000:])
        if kind == "plan":
            assert "No changes. Your infrastructure matches the configuration." in body, (name, body[:3000])
            assert not re.search(r"^Plan: ", body, re.M), (name, body[:3000])


def test_the_support_table_is_consistent_and_the_default_is_its_newest_standard_version():
    table = support_table()
    assert table["source"].startswith("Amazon EKS Kubernetes release calendar")
    for version, dates in table["versions"].items():
        released, standard, extended = (
            day(dates[k]) for k in ("released", "standard_support_ends", "extended_support_ends")
        )
        # EKS: 14 months of standard support from release, then 12 months of extended support
        assert 13 * 30 <= (standard - released).days <= 15 * 31, version
        assert 360 <= (extended - standard).days <= 370, version
    default = newest_standard_support_version()
    module_variables = (MODULE / "variables.tf").read_text()
    assert re.search(rf'variable "kubernetes_version" \{{[^}}]*default\s*=\s*"{re.escape(default)}"', module_variables)
    root = (TERRAFORM / "variables.tf").read_text()
    assert f'kubernetes_version  = optional(string, "{default}")' in root
    # the cluster-autoscaler follows the cluster's minor version (its compatibility rule)
    addons = (TERRAFORM.parent / "cluster" / "addons" / "cluster-autoscaler.yaml").read_text()
    assert f"cluster-autoscaler:v{default}." in addons
    # checkov's version skip states what the variable really enforces
    cluster = (MODULE / "cluster.tf").read_text()
    assert "eks-versions.json" in cluster and f"default {default}" in cluster


def test_the_default_version_is_in_standard_support_today():
    """Fails on the day the default leaves standard support: the signal to add the next version to the
    table (with its dates from the release calendar) and move the default."""
    dates = support_table()["versions"][newest_standard_support_version()]
    assert dt.date.today() < day(dates["standard_support_ends"]), (
        f"EKS {newest_standard_support_version()} left standard support on {dates['standard_support_ends']}: "
        "update modules/eks-gpu/eks-versions.json and the defaults"
    )


def test_the_key_that_encrypts_node_volumes_grants_the_auto_scaling_service_linked_role():
    node_groups = (MODULE / "node_groups.tf").read_text()
    kms = (MODULE / "kms.tf").read_text()
    keys_on_volumes = set(re.findall(r"kms_key_id\s*=\s*aws_kms_key\.(\w+)\.arn", node_groups))
    assert keys_on_volumes, "the launch templates encrypt root volumes with a module key"
    for key in keys_on_volumes:
        policy_doc = re.search(
            rf'resource "aws_kms_key" "{key}" \{{.*?policy\s*=\s*data\.aws_iam_policy_document\.(\w+)\.json', kms, re.S
        )
        assert policy_doc, key
        document = re.search(rf'data "aws_iam_policy_document" "{policy_doc.group(1)}" \{{(.*?)\n\}}', kms, re.S).group(
            1
        )
        statements = re.split(r"\n  statement \{", document)
        role = [s for s in statements if "autoscaling_service_linked_role_arn" in s]
        actions = " ".join(role)
        for action in (
            "kms:Encrypt",
            "kms:Decrypt",
            "kms:ReEncrypt*",
            "kms:GenerateDataKey*",
            "kms:DescribeKey",
            "kms:CreateGrant",
        ):
            assert f'"{action}"' in actions, action
        assert "kms:GrantIsForAWSResource" in actions
    assert "role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling" in kms
    assert 'resource "aws_iam_service_linked_role" "autoscaling"' in kms
    assert re.search(r"depends_on\s*=\s*\[aws_iam_service_linked_role\.autoscaling\]", kms)


def key_policy_statements(doc_name: str) -> list[str]:
    kms = (MODULE / "kms.tf").read_text()
    document = re.search(rf'data "aws_iam_policy_document" "{doc_name}" \{{(.*?)\n\}}', kms, re.S).group(1)
    return re.split(r"\n  statement \{", document)[1:]


def test_the_key_grants_cloudtrail_what_aws_cloudtrail_kms_page_requires():
    """AWS "Configure AWS KMS key policies for CloudTrail": a trail's key lets CloudTrail encrypt
    (GenerateDataKey* under its encryption context), decrypt (required to create or update a trail whose
    bucket uses an S3 Bucket Key) and describe the key, each scoped to the trail by aws:SourceArn. A
    DescribeKey that needs an encryption context is never granted: CloudTrail calls it without one."""
    audit = (MODULE / "audit.tf").read_text()
    trail_key = re.search(
        r'resource "aws_cloudtrail" "(\w+)" \{.*?kms_key_id\s*=\s*aws_kms_key\.(\w+)\.arn', audit, re.S
    )
    assert trail_key and trail_key.group(2) == "this"
    bucket_sse = re.search(r'aws_s3_bucket_server_side_encryption_configuration" "audit" \{(.*?)\n\}', audit, re.S)
    assert "bucket_key_enabled = true" in bucket_sse.group(1)  # so CloudTrail needs kms:Decrypt
    cloudtrail = [s for s in key_policy_statements("kms") if '"cloudtrail.amazonaws.com"' in s]
    granted: dict[str, str] = {}
    for statement in cloudtrail:
        assert 'effect    = "Deny"' not in statement
        actions = re.search(r"actions\s*=\s*\[(.*?)\]", statement).group(1)
        for action in re.findall(r'"([^"]+)"', actions):
            granted[action] = statement
        # every CloudTrail statement names this trail (the confused-deputy guard the page recommends)
        assert re.search(r'variable = "aws:SourceArn"\s*values\s*=\s*\[local\.audit_trail_arn\]', statement), statement
    assert {"kms:GenerateDataKey*", "kms:Decrypt", "kms:DescribeKey"} <= set(granted), sorted(granted)
    assert "kms:EncryptionContext:aws:cloudtrail:arn" in granted["kms:GenerateDataKey*"]
    assert "kms:EncryptionContext" not in granted["kms:DescribeKey"]
    assert "kms:EncryptionContext" not in granted["kms:Decrypt"]
    # the trail ARN the key names is the trail the module creates
    assert re.search(r'audit_trail_name = "\$\{var\.cluster_name\}-artifacts"', audit)
    assert re.search(r"name\s*=\s*local\.audit_trail_name", audit)
    assert "trail/${local.audit_trail_name}" in audit
