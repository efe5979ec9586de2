# Launch templates: IMDSv2 only with a hop limit of 1, so pods cannot take the node role's
# credentials (they get their own through Pod Identity, iam.tf), and encrypted gp3 root volumes.
resource "aws_launch_template" "pool" {
  for_each = {
    system = var.system_pool.disk_gib
    gpu    = var.gpu_pool.disk_gib
    cpu    = var.cpu_pool.disk_gib
  }
  name_prefix = "${var.cluster_name}-${each.key}-"

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = each.value
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = aws_kms_key.this.arn
      delete_on_termination = true
    }
  }

  tag_specifications {
    resource_type = "instance"
    tags          = { Name = "${var.cluster_name}-${each.key}" }
  }
}

# The groups scale between min_size and max_size under the cluster-autoscaler
# (infra/cluster/cluster-autoscaler.yaml), which finds their ASGs by the k8s.io/cluster-autoscaler/*
# tags EKS puts on managed node groups; desired_size is only the starting point.
resource "aws_eks_node_group" "system" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "${var.cluster_name}-system"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = aws_subnet.private[*].id
  instance_types  = var.system_pool.instance_types
  ami_type        = "AL2023_x86_64_STANDARD"

  launch_template {
    id      = aws_launch_template.pool["system"].id
    version = aws_launch_template.pool["system"].latest_version
  }

  scaling_config {
    min_size     = var.system_pool.min_size
    desired_size = var.system_pool.desired_size
    max_size     = var.system_pool.max_size
  }

  labels = { "joynexus.io/node-pool" = "system" }

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size] # owned by the cluster-autoscaler
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}

# CPU nodes for the Ray environment workers (tenant simulators): kept apart from the system pool,
# where the control plane runs.
resource "aws_eks_node_group" "cpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "${var.cluster_name}-cpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = aws_subnet.private[*].id
  instance_types  = var.cpu_pool.instance_types
  ami_type        = "AL2023_x86_64_STANDARD"

  launch_template {
    id      = aws_launch_template.pool["cpu"].id
    version = aws_launch_template.pool["cpu"].latest_version
  }

  scaling_config {
    min_size     = var.cpu_pool.min_size
    desired_size = var.cpu_pool.desired_size
    max_size     = var.cpu_pool.max_size
  }

  labels = { "joynexus.io/node-pool" = "cpu" }

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size] # owned by the cluster-autoscaler
  }

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

  launch_template {
    id      = aws_launch_template.pool["gpu"].id
    version = aws_launch_template.pool["gpu"].latest_version
  }

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

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size] # owned by the cluster-autoscaler
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}
