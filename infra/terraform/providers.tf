provider "aws" {
  region = var.region

  default_tags {
    tags = merge({ "app.kubernetes.io/part-of" = "joynexus" }, var.tags)
  }
}

# Both talk to the cluster this configuration creates, with a short-lived EKS token.
data "aws_eks_cluster_auth" "this" {
  name = module.eks_gpu.cluster_name
}

provider "kubernetes" {
  host                   = module.eks_gpu.cluster_endpoint
  cluster_ca_certificate = base64decode(module.eks_gpu.cluster_ca_certificate)
  token                  = data.aws_eks_cluster_auth.this.token
}

provider "helm" {
  kubernetes {
    host                   = module.eks_gpu.cluster_endpoint
    cluster_ca_certificate = base64decode(module.eks_gpu.cluster_ca_certificate)
    token                  = data.aws_eks_cluster_auth.this.token
  }
}
