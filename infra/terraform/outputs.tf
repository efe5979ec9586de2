output "cluster_name" {
  description = "EKS cluster name."
  value       = module.eks_gpu.cluster_name
}

output "cluster_endpoint" {
  description = "Kubernetes API endpoint."
  value       = module.eks_gpu.cluster_endpoint
}

output "region" {
  description = "AWS region."
  value       = var.region
}

output "artifact_bucket" {
  description = "Set JOYNEXUS_S3_BUCKET to this (deployments/config.yaml; infra/scripts/bootstrap-cluster does)."
  value       = module.eks_gpu.artifact_bucket
}

output "database_endpoint" {
  description = "host:port of the RDS PostgreSQL instance (control plane, MLflow and Prefect databases)."
  value       = module.eks_gpu.database_endpoint
}

output "database_secret_arn" {
  description = "Secrets Manager secret (RDS-managed, rotated) with the master user's name and password."
  value       = module.eks_gpu.database_secret_arn
}

output "shared_file_system_id" {
  description = "EFS file system for datasets and backbone weights (StorageClass joynexus-shared)."
  value       = module.eks_gpu.shared_file_system_id
}

output "kubeconfig_command" {
  description = "Write a kubeconfig entry for the cluster."
  value       = "aws eks update-kubeconfig --region ${var.region} --name ${module.eks_gpu.cluster_name}"
}

output "gcs_redis_address" {
  description = "rediss://host:port of the Ray GCS Redis; bootstrap-cluster writes it into the RayCluster."
  value       = module.eks_gpu.gcs_redis_address
}

output "gcs_redis_secret_arn" {
  description = "Secrets Manager secret with the GCS Redis AUTH token (Secret joynexus-ray-gcs)."
  value       = module.eks_gpu.gcs_redis_secret_arn
}

output "tenant_artifacts_role_arn" {
  description = "Role a process running one tenant's code assumes with the session tag joynexus-tenant=<id>: that tenant's S3 prefixes only."
  value       = module.eks_gpu.tenant_artifacts_role_arn
}

output "image_registry" {
  description = "Where bootstrap-cluster pushes and the pods pull the images: <registry>/joynexus[-cpu]:<tag> (ECR)."
  value       = module.eks_gpu.image_registry
}
