# Ray GCS fault tolerance: the head's GCS keeps its tables in this Redis (KubeRay
# gcsFaultToleranceOptions, deployments/ray/raycluster.yaml), so a restarted head reloads the
# detached service actors (Master, queues, model and environment services) instead of losing them.
# ElastiCache Redis OSS, a primary and a replica in two zones with automatic failover, TLS in
# transit, the module's key at rest, an AUTH token in Secrets Manager; reachable only from the nodes.
resource "aws_elasticache_subnet_group" "gcs" {
  name       = "${var.cluster_name}-gcs"
  subnet_ids = aws_subnet.private[*].id
}

resource "aws_security_group" "gcs" {
  name        = "${var.cluster_name}-gcs"
  description = "Redis (Ray GCS fault tolerance) from the EKS nodes only"
  vpc_id      = aws_vpc.this.id

  ingress {
    description     = "Redis from the EKS cluster security group"
    from_port       = 6379
    to_port         = 6379
    protocol        = "tcp"
    security_groups = [aws_eks_cluster.this.vpc_config[0].cluster_security_group_id]
  }

  tags = { Name = "${var.cluster_name}-gcs" }
}

# The aws provider's own generator (no random provider here). It yields a new value at every plan,
# so the token is kept by the secret and the group (ignore_changes) and changed by an operator only.
data "aws_secretsmanager_random_password" "gcs" {
  password_length     = 64
  exclude_punctuation = true
}

resource "aws_secretsmanager_secret" "gcs" {
  #checkov:skip=CKV2_AWS_57:Ray reads the Redis password when the head starts; the token is rotated by the documented procedure (docs/deployment.md: modify the group's auth token with ROTATE, then restart the head), not by a Lambda
  name                    = "${var.cluster_name}/ray-gcs-redis"
  description             = "AUTH token of the Ray GCS Redis (bootstrap-cluster copies it into the Secret joynexus-ray-gcs)"
  kms_key_id              = aws_kms_key.this.arn
  recovery_window_in_days = 7
}

resource "aws_secretsmanager_secret_version" "gcs" {
  secret_id     = aws_secretsmanager_secret.gcs.id
  secret_string = data.aws_secretsmanager_random_password.gcs.random_password
  lifecycle {
    ignore_changes = [secret_string]
  }
}

resource "aws_elasticache_replication_group" "gcs" {
  replication_group_id       = "${var.cluster_name}-gcs"
  description                = "Ray GCS fault tolerance for ${var.cluster_name}"
  engine                     = "redis"
  engine_version             = "7.1"
  node_type                  = var.gcs_redis.node_type
  num_cache_clusters         = 2
  automatic_failover_enabled = true
  multi_az_enabled           = true
  port                       = 6379

  subnet_group_name  = aws_elasticache_subnet_group.gcs.name
  security_group_ids = [aws_security_group.gcs.id]

  at_rest_encryption_enabled = true
  kms_key_id                 = aws_kms_key.this.arn
  transit_encryption_enabled = true
  auth_token                 = aws_secretsmanager_secret_version.gcs.secret_string

  snapshot_retention_limit   = var.gcs_redis.snapshot_retention_days
  auto_minor_version_upgrade = true

  lifecycle {
    ignore_changes = [auth_token]
  }
}
