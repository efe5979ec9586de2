data "aws_iam_policy_document" "cluster_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["eks.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "cluster" {
  name               = "${var.cluster_name}-cluster"
  assume_role_policy = data.aws_iam_policy_document.cluster_assume.json
}

resource "aws_iam_role_policy_attachment" "cluster" {
  role       = aws_iam_role.cluster.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonEKSClusterPolicy"
}

data "aws_iam_policy_document" "node_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

# The node role carries only what the kubelet and the CNI need. No pod gets S3 through it: S3 is
# granted per pod below (EKS Pod Identity, the successor of IRSA: no OIDC provider to manage and no
# role ARN annotation in the manifests).
resource "aws_iam_role" "node" {
  name               = "${var.cluster_name}-node"
  assume_role_policy = data.aws_iam_policy_document.node_assume.json
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset([
    "AmazonEKSWorkerNodePolicy",
    "AmazonEKS_CNI_Policy",
    "AmazonEC2ContainerRegistryReadOnly",
  ])
  role       = aws_iam_role.node.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/${each.value}"
}

# -- per-pod IAM ---------------------------------------------------------------------------------
data "aws_iam_policy_document" "pod_assume" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]
    principals {
      type        = "Service"
      identifiers = ["pods.eks.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [data.aws_caller_identity.current.account_id]
    }
  }
}

locals {
  # role key => (namespace, service account). Bound by aws_eks_pod_identity_association (or, for the
  # CSI drivers, by their add-on's pod_identity_association).
  pod_roles = {
    ray                = { namespace = var.namespace, service_account = "joynexus-ray" }            # checkpoints (Training Model Service), MLflow artifacts (Master)
    mlflow             = { namespace = var.namespace, service_account = "joynexus-mlflow" }         # MLflow artifact proxy
    api                = { namespace = var.namespace, service_account = "joynexus-api" }            # reads checkpoints (export, manifests)
    prefect-worker     = { namespace = var.namespace, service_account = "joynexus-prefect-worker" } # flow runs: MLflow artifacts (evaluations, sweeps)
    external-secrets   = { namespace = "external-secrets", service_account = "external-secrets" }   # reads the secrets below into Kubernetes Secrets
    cluster-autoscaler = { namespace = "kube-system", service_account = "cluster-autoscaler" }
    ebs-csi            = { namespace = "kube-system", service_account = "ebs-csi-controller-sa" }
    efs-csi            = { namespace = "kube-system", service_account = "efs-csi-controller-sa" }
  }
}

resource "aws_iam_role" "pod" {
  for_each           = local.pod_roles
  name               = "${var.cluster_name}-${each.key}"
  assume_role_policy = data.aws_iam_policy_document.pod_assume.json
}

resource "aws_eks_pod_identity_association" "pod" {
  for_each        = { for k, v in local.pod_roles : k => v if !contains(["ebs-csi", "efs-csi"], k) }
  cluster_name    = aws_eks_cluster.this.name
  namespace       = each.value.namespace
  service_account = each.value.service_account
  role_arn        = aws_iam_role.pod[each.key].arn
}

locals {
  # Each pod role reaches only the prefixes its processes use (joynexus/settings.py: checkpoints/ and
  # mlflow/ under the bucket; tenants' datasets under datasets/), not the whole bucket.
  artifact_access = {
    ray            = { write = ["checkpoints", "mlflow"], read = ["datasets"] } # Training Model Service, Master
    mlflow         = { write = ["mlflow"], read = [] }                          # MLflow's artifact proxy
    api            = { write = ["datasets"], read = ["checkpoints"] }           # tenants' uploads (shared with the Master); exports, manifests
    prefect-worker = { write = ["mlflow"], read = [] }                          # flow runs log to MLflow, whose artifacts are in S3
  }
}

data "aws_iam_policy_document" "artifacts" {
  for_each = local.artifact_access
  statement {
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.artifacts.arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [for prefix in concat(each.value.write, each.value.read) : "${prefix}/*"]
    }
  }
  statement {
    actions   = ["s3:GetObject"]
    resources = [for prefix in concat(each.value.write, each.value.read) : "${aws_s3_bucket.artifacts.arn}/${prefix}/*"]
  }
  dynamic "statement" {
    for_each = length(each.value.write) > 0 ? [1] : []
    content {
      actions   = ["s3:PutObject", "s3:DeleteObject"]
      resources = [for prefix in each.value.write : "${aws_s3_bucket.artifacts.arn}/${prefix}/*"]
    }
  }
  statement {
    actions   = length(each.value.write) > 0 ? ["kms:Decrypt", "kms:GenerateDataKey"] : ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]
  }
}

resource "aws_iam_role_policy" "artifacts" {
  for_each = local.artifact_access
  name     = "${var.cluster_name}-artifacts-${each.key}"
  role     = aws_iam_role.pod[each.key].id
  policy   = data.aws_iam_policy_document.artifacts[each.key].json
}

# -- per-tenant S3 prefixes ------------------------------------------------------------------------
# A process that runs ONE tenant's code gets credentials for that tenant's prefixes only: the ray
# role assumes tenant-artifacts with the session tag joynexus-tenant=<tenant id>, and the policy
# below resolves ${aws:PrincipalTag/joynexus-tenant} to that id, so another tenant's objects are
# out of reach of those credentials. (Tenant code that runs inside the shared services' processes
# shares their credentials; docs/deployment.md says what this does and does not isolate.)
data "aws_iam_policy_document" "tenant_artifacts_assume" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]
    principals {
      type        = "AWS"
      identifiers = [aws_iam_role.pod["ray"].arn]
    }
    condition { # the session must name its tenant, and may set no other tag
      test     = "StringLike"
      variable = "aws:RequestTag/joynexus-tenant"
      values   = ["?*"]
    }
    condition {
      test     = "ForAllValues:StringEquals"
      variable = "aws:TagKeys"
      values   = ["joynexus-tenant"]
    }
  }
}

resource "aws_iam_role" "tenant_artifacts" {
  name                 = "${var.cluster_name}-tenant-artifacts"
  assume_role_policy   = data.aws_iam_policy_document.tenant_artifacts_assume.json
  max_session_duration = 3600
}

data "aws_iam_policy_document" "tenant_artifacts" {
  statement {
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.artifacts.arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["checkpoints/$${aws:PrincipalTag/joynexus-tenant}/*", "datasets/$${aws:PrincipalTag/joynexus-tenant}/*"]
    }
  }
  statement {
    actions = ["s3:GetObject", "s3:PutObject"]
    resources = [
      "${aws_s3_bucket.artifacts.arn}/checkpoints/$${aws:PrincipalTag/joynexus-tenant}/*",
      "${aws_s3_bucket.artifacts.arn}/datasets/$${aws:PrincipalTag/joynexus-tenant}/*",
    ]
  }
  statement {
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.this.arn]
  }
}

resource "aws_iam_role_policy" "tenant_artifacts" {
  name   = "${var.cluster_name}-tenant-artifacts"
  role   = aws_iam_role.tenant_artifacts.id
  policy = data.aws_iam_policy_document.tenant_artifacts.json
}

data "aws_iam_policy_document" "ray_assume_tenant" {
  statement {
    actions   = ["sts:AssumeRole", "sts:TagSession"]
    resources = [aws_iam_role.tenant_artifacts.arn]
  }
}

resource "aws_iam_role_policy" "ray_assume_tenant" {
  name   = "${var.cluster_name}-ray-assume-tenant"
  role   = aws_iam_role.pod["ray"].id
  policy = data.aws_iam_policy_document.ray_assume_tenant.json
}

resource "aws_iam_role_policy_attachment" "csi" {
  for_each = {
    ebs-csi = "service-role/AmazonEBSCSIDriverPolicy"
    efs-csi = "service-role/AmazonEFSCSIDriverPolicy"
  }
  role       = aws_iam_role.pod[each.key].name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/${each.value}"
}

# cluster-autoscaler (infra/cluster/cluster-autoscaler.yaml): auto-discovers the node groups' ASGs by
# the tags EKS puts on them; scaling calls are limited to ASGs tagged with this cluster.
data "aws_iam_policy_document" "cluster_autoscaler" {
  #checkov:skip=CKV_AWS_356:the Describe*/Get* calls of the first statement take no resource ARNs; the scaling calls are restricted by the cluster's ASG tag
  statement {
    actions = [
      "autoscaling:DescribeAutoScalingGroups",
      "autoscaling:DescribeAutoScalingInstances",
      "autoscaling:DescribeLaunchConfigurations",
      "autoscaling:DescribeScalingActivities",
      "autoscaling:DescribeTags",
      "ec2:DescribeImages",
      "ec2:DescribeInstanceTypes",
      "ec2:DescribeLaunchTemplateVersions",
      "ec2:GetInstanceTypesFromInstanceRequirements",
      "eks:DescribeNodegroup",
    ]
    resources = ["*"] # Describe* calls take no resource ARNs
  }
  statement {
    actions   = ["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"]
    resources = ["*"]
    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/k8s.io/cluster-autoscaler/${var.cluster_name}"
      values   = ["owned"]
    }
  }
}

resource "aws_iam_role_policy" "cluster_autoscaler" {
  name   = "${var.cluster_name}-cluster-autoscaler"
  role   = aws_iam_role.pod["cluster-autoscaler"].id
  policy = data.aws_iam_policy_document.cluster_autoscaler.json
}

data "aws_iam_policy_document" "ebs_kms" {
  statement {
    actions   = ["kms:CreateGrant", "kms:Decrypt", "kms:DescribeKey", "kms:Encrypt", "kms:GenerateDataKey*", "kms:ReEncrypt*"]
    resources = [aws_kms_key.this.arn]
  }
}

resource "aws_iam_role_policy" "ebs_kms" {
  name   = "${var.cluster_name}-ebs-kms"
  role   = aws_iam_role.pod["ebs-csi"].id
  policy = data.aws_iam_policy_document.ebs_kms.json
}

# External Secrets Operator (installed by bootstrap-cluster): reads exactly the secrets the
# deployment syncs (deployments/secrets/): the RDS-managed master secret, the per-app database
# logins, the GCS Redis token and the MLflow login. Nothing else in Secrets Manager.
data "aws_iam_policy_document" "external_secrets" {
  statement {
    actions = ["secretsmanager:GetSecretValue", "secretsmanager:DescribeSecret"]
    resources = concat(
      [aws_db_instance.this.master_user_secret[0].secret_arn, aws_secretsmanager_secret.gcs.arn, aws_secretsmanager_secret.mlflow_auth.arn],
      [for s in aws_secretsmanager_secret.db_app : s.arn],
    )
  }
  statement {
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["secretsmanager.${data.aws_region.current.name}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role_policy" "external_secrets" {
  name   = "${var.cluster_name}-external-secrets"
  role   = aws_iam_role.pod["external-secrets"].id
  policy = data.aws_iam_policy_document.external_secrets.json
}
