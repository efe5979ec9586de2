# `terraform test` with a mocked aws provider (offline): the defaults plan, and the inputs the module
# must refuse. Run by tests/deploy/test_terraform_plan.py.
mock_provider "aws" {
  mock_data "aws_caller_identity" {
    defaults = { account_id = "123456789012" }
  }
  mock_data "aws_partition" {
    defaults = { partition = "aws" }
  }
  mock_data "aws_region" {
    defaults = { name = "us-east-1" }
  }
  mock_data "aws_availability_zones" {
    defaults = { names = ["us-east-1a", "us-east-1b", "us-east-1c"] }
  }
  # Policy documents are rendered by the provider; a mock renders a valid empty one (the key policy's
  # statements are checked from the source by tests/deploy/test_terraform_plan.py).
  mock_data "aws_iam_policy_document" {
    defaults = { json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}" }
  }
  mock_data "aws_secretsmanager_random_password" {
    defaults = { random_password = "mockedGcsRedisAuthTokenOfSixtyFourAlphanumericCharacters0123456" }
  }
  mock_data "aws_iam_roles" {
    defaults = { names = [] }
  }
}

variables {
  cluster_name = "joynexus"
  system_pool  = {}
  gpu_pool     = {}
}

run "defaults_plan_in_a_fresh_account" {
  command = plan

  assert {
    condition     = aws_eks_cluster.this.version == "1.35"
    error_message = "the default Kubernetes version is the newest in standard support"
  }
  assert {
    condition     = length(aws_iam_service_linked_role.autoscaling) == 1
    error_message = "a fresh account gets the Auto Scaling service-linked role the key policy names"
  }
  assert {
    condition     = aws_elasticache_replication_group.gcs.automatic_failover_enabled && aws_elasticache_replication_group.gcs.transit_encryption_enabled
    error_message = "the Ray GCS Redis fails over and speaks TLS"
  }
  assert {
    condition     = aws_cloudtrail.artifacts.enable_log_file_validation
    error_message = "the artifact bucket's data events are recorded"
  }
  assert {
    condition     = toset(keys(aws_secretsmanager_secret.db_app)) == toset(["control-plane", "mlflow", "prefect"])
    error_message = "each app has its own database login in Secrets Manager"
  }
  assert {
    condition     = toset([for s in aws_secretsmanager_secret.db_app : s.name]) == toset(["joynexus/db/control-plane", "joynexus/db/mlflow", "joynexus/db/prefect"])
    error_message = "the app secrets have the names deployments/secrets/external-secrets.yaml reads"
  }
  assert {
    condition     = aws_secretsmanager_secret.mlflow_auth.name == "joynexus/mlflow-auth" && aws_secretsmanager_secret.gcs.name == "joynexus/ray-gcs-redis"
    error_message = "the MLflow login and the GCS token have the names the ExternalSecrets read"
  }
  assert {
    condition     = aws_eks_pod_identity_association.pod["external-secrets"].namespace == "external-secrets" && aws_eks_pod_identity_association.pod["external-secrets"].service_account == "external-secrets"
    error_message = "the External Secrets Operator's service account gets its Secrets Manager role"
  }
  assert {
    condition     = !contains(keys(aws_eks_pod_identity_association.pod), "tenant-artifacts") && aws_iam_role.tenant_artifacts.max_session_duration == 3600
    error_message = "the per-tenant artifacts role is assumed by session, never bound to a pod"
  }
}

run "an_account_that_has_the_service_linked_role_does_not_create_it_again" {
  command = plan

  override_data {
    target = data.aws_iam_roles.autoscaling_service_linked
    values = { names = ["AWSServiceRoleForAutoScaling"] }
  }

  assert {
    condition     = length(aws_iam_service_linked_role.autoscaling) == 0
    error_message = "creating AWSServiceRoleForAutoScaling twice fails the apply"
  }
}

run "a_version_past_standard_support_is_refused" {
  command = plan
  variables {
    kubernetes_version = "1.33"
  }
  expect_failures = [var.kubernetes_version]
}

run "an_unknown_version_is_refused" {
  command = plan
  variables {
    kubernetes_version = "1.99"
  }
  expect_failures = [var.kubernetes_version]
}

run "a_short_audit_retention_is_refused" {
  command = plan
  variables {
    audit_log_days = 7
  }
  expect_failures = [var.audit_log_days]
}

run "gcs_redis_without_snapshots_is_refused" {
  command = plan
  variables {
    gcs_redis = { snapshot_retention_days = 0 }
  }
  expect_failures = [var.gcs_redis]
}

run "a_role_another_deployment_created_is_left_to_it" {
  command = plan

  override_data {
    target = data.aws_iam_roles.autoscaling_service_linked
    values = { names = ["AWSServiceRoleForAutoScaling"] }
  }
  override_data {
    target = data.aws_iam_role.autoscaling_service_linked
    values = { tags = { "joynexus-created-by" = "another-cluster" } }
  }

  assert {
    condition     = length(aws_iam_service_linked_role.autoscaling) == 0
    error_message = "only the deployment that created the role manages it"
  }
}
