# RDS PostgreSQL: one instance, three databases (joynexus: the control plane, mlflow, prefect), each
# owned by its own application role (least privilege: login and its own database only). The master
# password is generated and rotated by RDS in Secrets Manager (manage_master_user_password),
# encrypted with this module's key; only the Job joynexus-db-users uses it (joynexus/ops/db_users.py
# creates the app roles and databases). The app credentials are secrets of their own below. The
# External Secrets Operator (role external-secrets in iam.tf) keeps all of them in sync as
# Kubernetes Secrets (deployments/secrets/). Reachable only from the nodes.
resource "aws_db_subnet_group" "this" {
  name       = "${var.cluster_name}-db"
  subnet_ids = aws_subnet.private[*].id
}

resource "aws_security_group" "db" {
  name        = "${var.cluster_name}-db"
  description = "PostgreSQL from the EKS nodes only"
  vpc_id      = aws_vpc.this.id

  ingress {
    description     = "PostgreSQL from the EKS cluster security group"
    from_port       = 5432
    to_port         = 5432
    protocol        = "tcp"
    security_groups = [aws_eks_cluster.this.vpc_config[0].cluster_security_group_id]
  }

  tags = { Name = "${var.cluster_name}-db" }
}

resource "aws_db_parameter_group" "this" {
  name   = "${var.cluster_name}-pg${split(".", var.database.engine_version)[0]}"
  family = "postgres${split(".", var.database.engine_version)[0]}"

  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }
  parameter {
    name         = "rds.force_ssl"
    value        = "1"
    apply_method = "pending-reboot"
  }
}

resource "aws_db_instance" "this" {
  #checkov:skip=CKV_AWS_293:deletion_protection defaults to true (var.database.deletion_protection); false only for throw-away test stacks
  #checkov:skip=CKV_AWS_133:backup_retention_period defaults to 7 days (var.database.backup_retention_days); checkov cannot read optional() defaults
  #checkov:skip=CKV_AWS_157:multi_az defaults to true (var.database.multi_az); single-AZ only for test stacks
  identifier     = "${var.cluster_name}-db"
  engine         = "postgres"
  engine_version = var.database.engine_version
  instance_class = var.database.instance_class

  allocated_storage     = var.database.allocated_storage_gib
  max_allocated_storage = var.database.max_storage_gib
  storage_type          = "gp3"
  storage_encrypted     = true
  kms_key_id            = aws_kms_key.this.arn

  db_name                       = "joynexus"
  username                      = "joynexus"
  manage_master_user_password   = true
  master_user_secret_kms_key_id = aws_kms_key.this.arn

  db_subnet_group_name   = aws_db_subnet_group.this.name
  vpc_security_group_ids = [aws_security_group.db.id]
  parameter_group_name   = aws_db_parameter_group.this.name
  publicly_accessible    = false
  multi_az               = var.database.multi_az

  backup_retention_period             = var.database.backup_retention_days
  deletion_protection                 = var.database.deletion_protection
  skip_final_snapshot                 = false
  final_snapshot_identifier           = "${var.cluster_name}-db-final"
  copy_tags_to_snapshot               = true
  auto_minor_version_upgrade          = true
  iam_database_authentication_enabled = true
  enabled_cloudwatch_logs_exports     = ["postgresql", "upgrade"]

  performance_insights_enabled    = true
  performance_insights_kms_key_id = aws_kms_key.this.arn
  monitoring_interval             = 60
  monitoring_role_arn             = aws_iam_role.rds_monitoring.arn
}

data "aws_iam_policy_document" "rds_monitoring_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["monitoring.rds.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "rds_monitoring" {
  name               = "${var.cluster_name}-rds-monitoring"
  assume_role_policy = data.aws_iam_policy_document.rds_monitoring_assume.json
}

resource "aws_iam_role_policy_attachment" "rds_monitoring" {
  role       = aws_iam_role.rds_monitoring.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/service-role/AmazonRDSEnhancedMonitoringRole"
}

# -- per-application users ------------------------------------------------------------------------
locals {
  # app => its PostgreSQL role and database (the control plane keeps RDS's db_name "joynexus").
  db_apps = {
    control-plane = { username = "joynexus_app", dbname = "joynexus" }
    mlflow        = { username = "mlflow", dbname = "mlflow" }
    prefect       = { username = "prefect", dbname = "prefect" }
  }
}

# The aws provider's own generator (no random provider). It yields a new value at every plan, so the
# secret keeps the first one (ignore_changes); a rotation puts a new value (docs/deployment.md).
data "aws_secretsmanager_random_password" "db_app" {
  for_each            = local.db_apps
  password_length     = 40
  exclude_punctuation = true
}

resource "aws_secretsmanager_secret" "db_app" {
  #checkov:skip=CKV2_AWS_57:the app passwords are rotated by the documented procedure (docs/deployment.md: put a new value, the External Secrets Operator syncs it, the Job joynexus-db-users sets it on the role, the app restarts); RDS rotates the master, which only that Job uses
  for_each                = local.db_apps
  name                    = "${var.cluster_name}/db/${each.key}"
  description             = "PostgreSQL login of ${each.key} (role ${each.value.username}, database ${each.value.dbname})"
  kms_key_id              = aws_kms_key.this.arn
  recovery_window_in_days = 7
}

resource "aws_secretsmanager_secret_version" "db_app" {
  for_each  = local.db_apps
  secret_id = aws_secretsmanager_secret.db_app[each.key].id
  secret_string = jsonencode({
    username = each.value.username
    password = data.aws_secretsmanager_random_password.db_app[each.key].random_password
    dbname   = each.value.dbname
    host     = aws_db_instance.this.address
    port     = tostring(aws_db_instance.this.port)
  })
  lifecycle {
    ignore_changes = [secret_string]
  }
}

# The MLflow server runs its basic-auth app (deployments/mlflow/mlflow.yaml); this is its admin login,
# the one JoyNexus's MLflow clients use (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD).
data "aws_secretsmanager_random_password" "mlflow_auth" {
  password_length     = 40
  exclude_punctuation = true
}

# The Flask secret key of MLflow's auth app (CSRF tokens; one value for all its workers and replicas).
data "aws_secretsmanager_random_password" "mlflow_flask_key" {
  password_length     = 64
  exclude_punctuation = true
}

resource "aws_secretsmanager_secret" "mlflow_auth" {
  #checkov:skip=CKV2_AWS_57:MLflow keeps the admin password in its own user store once created; it is rotated by the documented procedure (docs/deployment.md: MLflow's update-password API, then a new value here, which the External Secrets Operator syncs to the clients), not by a Lambda
  name                    = "${var.cluster_name}/mlflow-auth"
  description             = "MLflow basic-auth admin login of the JoyNexus MLflow clients"
  kms_key_id              = aws_kms_key.this.arn
  recovery_window_in_days = 7
}

resource "aws_secretsmanager_secret_version" "mlflow_auth" {
  secret_id = aws_secretsmanager_secret.mlflow_auth.id
  secret_string = jsonencode({
    username         = "joynexus"
    password         = data.aws_secretsmanager_random_password.mlflow_auth.random_password
    flask_secret_key = data.aws_secretsmanager_random_password.mlflow_flask_key.random_password
  })
  lifecycle {
    ignore_changes = [secret_string]
  }
}
