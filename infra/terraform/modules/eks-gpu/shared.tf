# The shared ReadWriteMany volume for datasets and backbone weights: EFS, mounted through the EFS
# CSI driver (cluster.tf) by the StorageClass `joynexus-shared` (infra/cluster/, its fileSystemId
# filled in by infra/scripts/bootstrap-cluster) and the PVC deployments/storage/shared-pvc.yaml.
resource "aws_efs_file_system" "shared" {
  creation_token   = "${var.cluster_name}-shared"
  encrypted        = true
  kms_key_id       = aws_kms_key.this.arn
  performance_mode = "generalPurpose"
  throughput_mode  = "elastic"

  lifecycle_policy {
    transition_to_ia = "AFTER_30_DAYS"
  }

  tags = { Name = "${var.cluster_name}-shared" }
}

resource "aws_efs_backup_policy" "shared" {
  file_system_id = aws_efs_file_system.shared.id
  backup_policy {
    status = "ENABLED"
  }
}

resource "aws_security_group" "efs" {
  name        = "${var.cluster_name}-efs"
  description = "NFS from the cluster's nodes to the shared file system"
  vpc_id      = aws_vpc.this.id

  ingress {
    description     = "NFS from the EKS nodes"
    from_port       = 2049
    to_port         = 2049
    protocol        = "tcp"
    security_groups = [aws_eks_cluster.this.vpc_config[0].cluster_security_group_id]
  }

  tags = { Name = "${var.cluster_name}-efs" }
}

resource "aws_efs_mount_target" "shared" {
  count           = length(local.zones)
  file_system_id  = aws_efs_file_system.shared.id
  subnet_id       = aws_subnet.private[count.index].id
  security_groups = [aws_security_group.efs.id]
}
