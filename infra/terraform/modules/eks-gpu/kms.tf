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
}

resource "aws_kms_alias" "this" {
  name          = "alias/${var.cluster_name}"
  target_key_id = aws_kms_key.this.key_id
}

data "aws_partition" "current" {}
