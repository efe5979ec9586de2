# Who read or wrote which tenant's artifacts: CloudTrail S3 data events for the artifact bucket
# (storage.tf audits access this way instead of server access logs), written to a bucket of their
# own, encrypted with the module's key and kept for var.audit_log_days.
resource "aws_s3_bucket" "audit" {
  #checkov:skip=CKV_AWS_18:this is the audit log bucket itself; logging its access would need a third bucket, and CloudTrail writes nothing else here
  #checkov:skip=CKV2_AWS_62:nothing consumes events of the audit log; it is read on demand
  #checkov:skip=CKV_AWS_144:audit logs stay in the deployment's region; cross-region replication is a per-deployment DR choice
  bucket = "${var.cluster_name}-audit-${data.aws_caller_identity.current.account_id}"
}

resource "aws_s3_bucket_versioning" "audit" {
  bucket = aws_s3_bucket.audit.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "audit" {
  bucket = aws_s3_bucket.audit.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_public_access_block" "audit" {
  bucket                  = aws_s3_bucket.audit.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_lifecycle_configuration" "audit" {
  bucket = aws_s3_bucket.audit.id
  rule {
    id     = "expire-audit-logs"
    status = "Enabled"
    filter {}
    expiration {
      days = var.audit_log_days
    }
    noncurrent_version_expiration {
      noncurrent_days = 30
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }
  depends_on = [aws_s3_bucket_versioning.audit]
}

locals {
  audit_trail_name = "${var.cluster_name}-artifacts"
  audit_trail_arn  = "arn:${data.aws_partition.current.partition}:cloudtrail:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:trail/${local.audit_trail_name}"
}

# CloudTrail's documented bucket policy (AWS: "Amazon S3 bucket policy for CloudTrail"), scoped to
# this trail, plus TLS only.
data "aws_iam_policy_document" "audit" {
  statement {
    sid       = "CloudTrailAclCheck"
    actions   = ["s3:GetBucketAcl"]
    resources = [aws_s3_bucket.audit.arn]
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
    sid       = "CloudTrailWrite"
    actions   = ["s3:PutObject"]
    resources = ["${aws_s3_bucket.audit.arn}/AWSLogs/${data.aws_caller_identity.current.account_id}/*"]
    principals {
      type        = "Service"
      identifiers = ["cloudtrail.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "s3:x-amz-acl"
      values   = ["bucket-owner-full-control"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceArn"
      values   = [local.audit_trail_arn]
    }
  }
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.audit.arn, "${aws_s3_bucket.audit.arn}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "audit" {
  bucket     = aws_s3_bucket.audit.id
  policy     = data.aws_iam_policy_document.audit.json
  depends_on = [aws_s3_bucket_public_access_block.audit]
}

resource "aws_cloudtrail" "artifacts" {
  #checkov:skip=CKV_AWS_67:a data-event trail for one regional bucket; account-wide management events are the account's own trail, not this module's
  #checkov:skip=CKV_AWS_252:no one subscribes to delivery notifications; the logs are read on demand
  #checkov:skip=CKV2_AWS_10:the logs land in the audit bucket; streaming them to CloudWatch Logs as well is a per-deployment choice
  name                          = local.audit_trail_name
  s3_bucket_name                = aws_s3_bucket.audit.id
  kms_key_id                    = aws_kms_key.this.arn
  enable_log_file_validation    = true
  include_global_service_events = false

  # Data events only: every object-level read and write of the artifact bucket.
  advanced_event_selector {
    name = "artifact-bucket-object-access"
    field_selector {
      field  = "eventCategory"
      equals = ["Data"]
    }
    field_selector {
      field  = "resources.type"
      equals = ["AWS::S3::Object"]
    }
    field_selector {
      field       = "resources.ARN"
      starts_with = ["${aws_s3_bucket.artifacts.arn}/"]
    }
  }

  depends_on = [aws_s3_bucket_policy.audit]
}
