output "cluster_name" {
  description = "EKS cluster name."
  value       = aws_eks_cluster.this.name
}

output "cluster_endpoint" {
  description = "Kubernetes API endpoint."
  value       = aws_eks_cluster.this.endpoint
}

output "cluster_ca_certificate" {
  description = "Base64 cluster CA certificate."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "artifact_bucket" {
  description = "Bucket for checkpoints and MLflow artifacts."
  value       = aws_s3_bucket.artifacts.bucket
}

output "gpu_node_group" {
  description = "Name of the GPU node group."
  value       = aws_eks_node_group.gpu.node_group_name
}

output "database_endpoint" {
  description = "host:port of the PostgreSQL instance."
  value       = aws_db_instance.this.endpoint
}

output "database_secret_arn" {
  description = "Secrets Manager ARN of the RDS-managed master user secret."
  value       = aws_db_instance.this.master_user_secret[0].secret_arn
}

output "shared_file_system_id" {
  description = "EFS file system id of the shared datasets/weights volume."
  value       = aws_efs_file_system.shared.id
}

output "gcs_redis_address" {
  description = "rediss://host:port of the Ray GCS Redis (TLS)."
  value       = "rediss://${aws_elasticache_replication_group.gcs.primary_endpoint_address}:6379"
}

output "gcs_redis_secret_arn" {
  description = "Secrets Manager secret with the GCS Redis AUTH token."
  value       = aws_secretsmanager_secret.gcs.arn
}

output "tenant_artifacts_role_arn" {
  description = "Role a per-tenant process assumes with the session tag joynexus-tenant=<id> (its own S3 prefixes only)."
  value       = aws_iam_role.tenant_artifacts.arn
}

output "external_secrets_role_arn" {
  description = "Pod Identity role of the External Secrets Operator (service account external-secrets/external-secrets)."
  value       = aws_iam_role.pod["external-secrets"].arn
}

output "image_registry" {
  description = "Registry prefix of the deployment's images: <registry>/joynexus and <registry>/joynexus-cpu (ECR)."
  value       = trimsuffix(aws_ecr_repository.image["joynexus"].repository_url, "/joynexus")
}
