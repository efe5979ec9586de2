# RDS PostgreSQL: one instance, three databases (joynexus: the control plane, mlflow, prefect),
# created by infra/scripts/bootstrap-cluster. The master password is generated and rotated by RDS
# in Secrets Manager (manage_master_user_password), encrypted with this module's key; the bootstrap
# script reads it to build the Kubernetes Secret `joynexus-secrets`. Reachable only from the nodes.
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
