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
    ray                = { namespace = var.namespace, service_account = "joynexus-ray" }    # checkpoints (Training Model Service), MLflow artifacts (Master)
    mlflow             = { namespace = var.namespace, service_account = "joynexus-mlflow" } # MLflow artifact proxy
    api                = { namespace = var.namespace, service_account = "joynexus-api" }    # reads checkpoints (export, manifests)
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

data "aws_iam_policy_document" "artifacts_rw" {
  statement {
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.artifacts.arn]
  }
  statement {
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"]
    resources = ["${aws_s3_bucket.artifacts.arn}/*"]
  }
  statement {
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.this.arn]
  }
}

data "aws_iam_policy_document" "artifacts_ro" {
  statement {
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.artifacts.arn]
  }
  statement {
    actions   = ["s3:GetObject"]
    resources = ["${aws_s3_bucket.artifacts.arn}/*"]
  }
  statement {
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]
  }
}

resource "aws_iam_role_policy" "artifacts" {
  for_each = { ray = "rw", mlflow = "rw", api = "ro" }
  name     = "${var.cluster_name}-artifacts-${each.value}"
  role     = aws_iam_role.pod[each.key].id
  policy   = each.value == "rw" ? data.aws_iam_policy_document.artifacts_rw.json : data.aws_iam_policy_document.artifacts_ro.json
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
