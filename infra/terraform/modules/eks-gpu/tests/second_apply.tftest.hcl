# `terraform test` with a mocked aws provider (offline): apply the module, then plan the same state
# again as the account now answers. The second plan must change nothing: a plan that destroys or
# replaces what the first apply made (the Auto Scaling service-linked role, which the node groups
# launch with) fails the second `terraform apply`. tests/deploy/test_terraform_plan.py runs this with
# -verbose and reads the plans as well: every plan after an apply says "No changes".
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
  mock_data "aws_iam_policy_document" {
    defaults = { json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}" }
  }
  mock_data "aws_secretsmanager_random_password" {
    defaults = { random_password = "mockedGcsRedisAuthTokenOfSixtyFourAlphanumericCharacters0123456" }
  }
  mock_data "aws_iam_roles" {
    defaults = { names = [] }
  }
  # Mocked resources get random strings for computed attributes; the provider validates the ARNs that
  # other resources take, so the resources whose ARN is passed on get a well-formed one.
  mock_resource "aws_kms_key" {
    defaults = { arn = "arn:aws:kms:us-east-1:123456789012:key/00000000-0000-4000-8000-000000000000" }
  }
  mock_resource "aws_iam_role" {
    defaults = { arn = "arn:aws:iam::123456789012:role/mocked" }
  }
  mock_resource "aws_cloudwatch_log_group" {
    defaults = { arn = "arn:aws:logs:us-east-1:123456789012:log-group:mocked" }
  }
  mock_resource "aws_launch_template" {
    defaults = { id = "lt-0123456789abcdef0" }
  }
  # Computed blocks the module indexes: RDS's managed master secret, the cluster's CA.
  mock_resource "aws_db_instance" {
    defaults = { master_user_secret = [{ secret_arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:rds-mocked", kms_key_id = "", secret_status = "active" }] }
  }
  mock_resource "aws_eks_cluster" {
    defaults = { certificate_authority = [{ data = "bW9ja2Vk" }] }
  }
}

variables {
  cluster_name = "joynexus"
  system_pool  = {}
  gpu_pool     = {}
}

run "first_apply_in_a_fresh_account" {
  command = apply

  assert {
    condition     = length(aws_iam_service_linked_role.autoscaling) == 1
    error_message = "a fresh account gets the Auto Scaling service-linked role"
  }
  assert {
    condition     = aws_iam_service_linked_role.autoscaling[0].tags["joynexus-created-by"] == "joynexus"
    error_message = "the role this deployment created says so, so the next plan keeps it"
  }
}

# After the first apply the account has the role, tagged by this deployment.
run "second_plan_keeps_everything" {
  command = plan

  override_data {
    target = data.aws_iam_roles.autoscaling_service_linked
    values = { names = ["AWSServiceRoleForAutoScaling"] }
  }
  override_data {
    target = data.aws_iam_role.autoscaling_service_linked
    values = { tags = { "joynexus-created-by" = "joynexus" } }
  }

  assert {
    condition     = length(aws_iam_service_linked_role.autoscaling) == 1
    error_message = "the second plan destroys the service-linked role the first apply created"
  }
}

run "second_apply" {
  command = apply

  override_data {
    target = data.aws_iam_roles.autoscaling_service_linked
    values = { names = ["AWSServiceRoleForAutoScaling"] }
  }
  override_data {
    target = data.aws_iam_role.autoscaling_service_linked
    values = { tags = { "joynexus-created-by" = "joynexus" } }
  }

  assert {
    condition     = length(aws_iam_service_linked_role.autoscaling) == 1
    error_message = "the second apply keeps the service-linked role"
  }
}

run "third_plan_is_clean_too" {
  command = plan

  override_data {
    target = data.aws_iam_roles.autoscaling_service_linked
    values = { names = ["AWSServiceRoleForAutoScaling"] }
  }
  override_data {
    target = data.aws_iam_role.autoscaling_service_linked
    values = { tags = { "joynexus-created-by" = "joynexus" } }
  }

  assert {
    condition     = length(aws_iam_service_linked_role.autoscaling) == 1
    error_message = "the third plan keeps the service-linked role"
  }
}
