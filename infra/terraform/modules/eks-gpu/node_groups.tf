resource "aws_eks_node_group" "system" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "${var.cluster_name}-system"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = aws_subnet.private[*].id
  instance_types  = var.system_pool.instance_types
  ami_type        = "AL2023_x86_64_STANDARD"
  disk_size       = var.system_pool.disk_gib

  scaling_config {
    min_size     = var.system_pool.min_size
    desired_size = var.system_pool.desired_size
    max_size     = var.system_pool.max_size
  }

  labels = { "joynexus.io/node-pool" = "system" }

  depends_on = [aws_iam_role_policy_attachment.node]
}

# GPU nodes: the EKS accelerated AMI (NVIDIA driver + container toolkit), tainted so that only pods
# tolerating nvidia.com/gpu (the Ray workers, the device plugin) are scheduled there.
resource "aws_eks_node_group" "gpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "${var.cluster_name}-gpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = aws_subnet.private[*].id
  instance_types  = var.gpu_pool.instance_types
  capacity_type   = var.gpu_pool.capacity_type
  ami_type        = "AL2023_x86_64_NVIDIA"
  disk_size       = var.gpu_pool.disk_gib

  scaling_config {
    min_size     = var.gpu_pool.min_size
    desired_size = var.gpu_pool.desired_size
    max_size     = var.gpu_pool.max_size
  }

  labels = {
    "joynexus.io/node-pool"          = "gpu"
    "nvidia.com/gpu.present"         = "true"
    "node.kubernetes.io/accelerator" = "nvidia"
  }

  taint {
    key    = "nvidia.com/gpu"
    value  = "true"
    effect = "NO_SCHEDULE"
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}
