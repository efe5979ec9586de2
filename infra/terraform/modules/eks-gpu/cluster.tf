resource "aws_cloudwatch_log_group" "cluster" {
  name              = "/aws/eks/${var.cluster_name}/cluster"
  retention_in_days = 365
  kms_key_id        = aws_kms_key.this.arn
}

resource "aws_eks_cluster" "this" {
  #checkov:skip=CKV_AWS_39:the endpoint is private by default (var.public_endpoint = false); made public only on request, then limited to var.public_access_cidrs (validated: no 0.0.0.0/0, not empty)
  #checkov:skip=CKV_AWS_339:var.kubernetes_version is validated against the dated EKS support table eks-versions.json (standard support only; default 1.35, standard support until 2027-03-27); checkov cannot read the value through the variable
  name     = var.cluster_name
  version  = var.kubernetes_version
  role_arn = aws_iam_role.cluster.arn

  enabled_cluster_log_types = ["api", "audit", "authenticator", "controllerManager", "scheduler"]

  vpc_config {
    subnet_ids              = aws_subnet.private[*].id
    endpoint_private_access = true
    endpoint_public_access  = var.public_endpoint
    # The allow-list applies only when the endpoint is public; private-only clusters ignore it.
    public_access_cidrs = var.public_endpoint ? var.public_access_cidrs : null
  }

  encryption_config {
    resources = ["secrets"]
    provider {
      key_arn = aws_kms_key.this.arn
    }
  }

  access_config {
    authentication_mode                         = "API"
    bootstrap_cluster_creator_admin_permissions = true
  }

  lifecycle {
    precondition {
      condition     = !var.public_endpoint || length(var.public_access_cidrs) > 0
      error_message = "public_endpoint = true needs public_access_cidrs (the networks allowed to reach the Kubernetes API)."
    }
  }

  depends_on = [aws_iam_role_policy_attachment.cluster, aws_cloudwatch_log_group.cluster]
}

# EKS add-ons (managed by AWS, no helm): the VPC CNI with NetworkPolicy enforcement (the policies
# of deployments/ray/networkpolicy.yaml are real only with it), Pod Identity (per-pod IAM), and the
# EBS / EFS CSI drivers (gp3 volumes; the shared ReadWriteMany volume for datasets and weights).
resource "aws_eks_addon" "vpc_cni" {
  cluster_name                = aws_eks_cluster.this.name
  addon_name                  = "vpc-cni"
  resolve_conflicts_on_update = "OVERWRITE"
  configuration_values        = jsonencode({ enableNetworkPolicy = "true" })
}

resource "aws_eks_addon" "pod_identity" {
  cluster_name                = aws_eks_cluster.this.name
  addon_name                  = "eks-pod-identity-agent"
  resolve_conflicts_on_update = "OVERWRITE"
}

resource "aws_eks_addon" "ebs_csi" {
  cluster_name                = aws_eks_cluster.this.name
  addon_name                  = "aws-ebs-csi-driver"
  resolve_conflicts_on_update = "OVERWRITE"

  pod_identity_association {
    role_arn        = aws_iam_role.pod["ebs-csi"].arn
    service_account = "ebs-csi-controller-sa"
  }

  depends_on = [aws_eks_node_group.system, aws_eks_addon.pod_identity]
}

resource "aws_eks_addon" "efs_csi" {
  cluster_name                = aws_eks_cluster.this.name
  addon_name                  = "aws-efs-csi-driver"
  resolve_conflicts_on_update = "OVERWRITE"

  pod_identity_association {
    role_arn        = aws_iam_role.pod["efs-csi"].arn
    service_account = "efs-csi-controller-sa"
  }

  depends_on = [aws_eks_node_group.system, aws_eks_addon.pod_identity]
}
