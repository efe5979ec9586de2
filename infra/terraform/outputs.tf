output "cluster_name" {
  description = "EKS cluster name."
  value       = module.eks_gpu.cluster_name
}

output "cluster_endpoint" {
  description = "Kubernetes API endpoint."
  value       = module.eks_gpu.cluster_endpoint
}

output "artifact_bucket" {
  description = "Set JOYNEXUS_S3_BUCKET to this (deployments/config.yaml)."
  value       = module.eks_gpu.artifact_bucket
}

output "kuberay_namespace" {
  description = "Namespace of the KubeRay operator."
  value       = helm_release.kuberay_operator.namespace
}

output "kubeconfig_command" {
  description = "Write a kubeconfig entry for the cluster."
  value       = "aws eks update-kubeconfig --region ${var.region} --name ${module.eks_gpu.cluster_name}"
}
