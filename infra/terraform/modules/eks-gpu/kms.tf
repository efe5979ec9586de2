# One customer-managed key for the cluster's secrets envelope encryption, the artifact bucket, the
# database (storage, Performance Insights, its Secrets Manager secret), the EFS file system and logs.
data "aws_iam_policy_document" "kms" {
  #checkov:skip=CKV_AWS_111:a KMS key policy: "*" is the key itself; the account root statement is AWS's required default so IAM policies can grant use of the key
  #checkov:skip=CKV_AWS_356:a KMS key policy: "*" is the key itself, not every resource
  #checkov:skip=CKV_AWS_109:a KMS key policy: administration by the account root (IAM decides who) is AWS's required default, without it the key becomes unmanageable
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
  # Node groups' launch templates encrypt root volumes with this key (node_groups.tf). EC2 Auto
  # Scaling launches those instances as its service-linked role, so the key must grant that role use
  # of the key and grants for attaching the volume (AWS: "Required KMS key policy for use with
  # encrypted volumes"; terraform-aws-eks's disk-encryption example), or the node groups never start.
  statement {
    sid       = "AutoScalingUsesTheKeyForNodeVolumes"
    actions   = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = [local.autoscaling_service_linked_role_arn]
    }
  }
  statement {
    sid       = "AutoScalingAttachesNodeVolumes"
    actions   = ["kms:CreateGrant"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = [local.autoscaling_service_linked_role_arn]
    }
    condition {
      test     = "Bool"
      variable = "kms:GrantIsForAWSResource"
      values   = ["true"]
    }
  }
  # CloudTrail writes the artifact bucket's data events encrypted with this key (audit.tf). The three
  # statements AWS's "Configure AWS KMS key policies for CloudTrail" requires for a trail, each limited
  # to this trail by aws:SourceArn (the page's recommendation): encrypt (GenerateDataKey*, only under
  # a CloudTrail encryption context), decrypt (kms:Decrypt: required to create or update a trail whose
  # bucket uses an S3 Bucket Key, as the audit bucket does) and describe the key (DescribeKey, with no
  # encryption context: CloudTrail calls it without one, so a context condition would refuse it).
  # People reading the logs decrypt through IAM (the AccountAdministers statement lets IAM grant it).
  statement {
    sid       = "CloudTrailEncryptsAuditLogs"
    actions   = ["kms:GenerateDataKey*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["cloudtrail.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceArn"
      values   = [local.audit_trail_arn]
    }
    condition {
      test     = "StringLike"
      variable = "kms:EncryptionContext:aws:cloudtrail:arn"
      values   = ["arn:${data.aws_partition.current.partition}:cloudtrail:*:${data.aws_caller_identity.current.account_id}:trail/*"]
    }
  }
  statement {
    sid       = "CloudTrailDecryptsForTheBucketKey"
    actions   = ["kms:Decrypt"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["cloudtrail.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceArn"
      values   = [local.audit_trail_arn]
    }
  }
  statement {
    sid       = "CloudTrailDescribesTheKey"
    actions   = ["kms:DescribeKey"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["cloudtrail.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceArn"
      values   = [local.audit_trail_arn]
    }
  }
  statement {
    sid       = "CloudWatchLogs"
    actions   = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${data.aws_region.current.name}.amazonaws.com"]
    }
  }
}

resource "aws_kms_key" "this" {
  description         = "${var.cluster_name}: EKS secrets, artifacts, database, shared file system, logs"
  enable_key_rotation = true
  policy              = data.aws_iam_policy_document.kms.json

  # A key policy naming a principal that does not exist is refused (MalformedPolicyDocument).
  depends_on = [aws_iam_service_linked_role.autoscaling]
}

# AWSServiceRoleForAutoScaling exists once anything in the account used Auto Scaling; in a fresh
# account it does not yet, and creating it twice fails. The module creates it only when the lookup
# finds none, and tags what it created with the cluster's name: on every later plan the lookup finds
# the role, and the tag says it is this deployment's, so the count stays 1 (a count that followed the
# lookup alone would drop to 0 on the second plan and destroy the role the node groups launch with).
# A role found without that tag belongs to the account (or another deployment) and is left alone.
data "aws_iam_roles" "autoscaling_service_linked" {
  name_regex  = "^AWSServiceRoleForAutoScaling$"
  path_prefix = "/aws-service-role/autoscaling.amazonaws.com/"
}

data "aws_iam_role" "autoscaling_service_linked" {
  count = length(data.aws_iam_roles.autoscaling_service_linked.names)
  name  = "AWSServiceRoleForAutoScaling"
}

locals {
  autoscaling_role_owner_tag = "joynexus-created-by"
  autoscaling_role_found     = length(data.aws_iam_roles.autoscaling_service_linked.names) > 0
  autoscaling_role_ours      = local.autoscaling_role_found && try(data.aws_iam_role.autoscaling_service_linked[0].tags[local.autoscaling_role_owner_tag], "") == var.cluster_name
}

resource "aws_iam_service_linked_role" "autoscaling" {
  count            = !local.autoscaling_role_found || local.autoscaling_role_ours ? 1 : 0
  aws_service_name = "autoscaling.amazonaws.com"
  tags             = { (local.autoscaling_role_owner_tag) = var.cluster_name }
}

locals {
  autoscaling_service_linked_role_arn = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling"
}

resource "aws_kms_alias" "this" {
  name          = "alias/${var.cluster_name}"
  target_key_id = aws_kms_key.this.key_id
}

data "aws_partition" "current" {}
