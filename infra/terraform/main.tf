# The AWS side (network, EKS with a CPU and a GPU node group, the artifact bucket) is one module
# that needs only the aws provider; the in-cluster side (kuberay.tf, gpu.tf) uses helm.
module "eks_gpu" {
  source = "./modules/eks-gpu"

  cluster_name       = var.cluster.name
  kubernetes_version = var.cluster.kubernetes_version
  vpc_cidr           = var.cluster.vpc_cidr
  availability_zones = var.cluster.availability_zones
  public_endpoint    = var.cluster.public_endpoint
  system_pool        = var.node_pools.system
  gpu_pool           = var.node_pools.gpu
  artifact_bucket    = var.artifact_bucket
}
