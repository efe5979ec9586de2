# The AWS side is one module that needs only the aws provider: network, EKS (private endpoint or a
# CIDR allow-list, EKS add-ons for EBS/EFS CSI and Pod Identity), CPU and GPU node groups sized for
# the cluster-autoscaler, per-pod IAM roles, RDS PostgreSQL with its password in Secrets Manager,
# the artifact bucket with lifecycle rules, and an EFS file system for datasets and weights.
module "eks_gpu" {
  source = "./modules/eks-gpu"

  cluster_name         = var.cluster.name
  kubernetes_version   = var.cluster.kubernetes_version
  vpc_cidr             = var.cluster.vpc_cidr
  availability_zones   = var.cluster.availability_zones
  public_endpoint      = var.cluster.public_endpoint
  public_access_cidrs  = var.cluster.public_access_cidrs
  system_pool          = var.node_pools.system
  gpu_pool             = var.node_pools.gpu
  cpu_pool             = var.node_pools.cpu
  artifact_bucket      = var.artifact_bucket
  checkpoint_lifecycle = var.checkpoint_lifecycle
  database             = var.database
  namespace            = var.namespace
  gcs_redis            = var.gcs_redis
}
