data "aws_caller_identity" "current" {}

resource "aws_s3_bucket" "artifacts" {
  #checkov:skip=CKV_AWS_18:object access is audited with the CloudTrail S3 data events of audit.tf (aws_cloudtrail.artifacts), not with server access logs
  #checkov:skip=CKV2_AWS_62:nothing consumes object events: JoyNexus commits a checkpoint by writing its manifest last and reads it back itself
  #checkov:skip=CKV_AWS_144:checkpoints are reproducible training outputs (and the registered ones are in MLflow); cross-region replication is a per-deployment DR choice, not a default
  bucket = coalesce(var.artifact_bucket, "joynexus-artifacts-${data.aws_caller_identity.current.account_id}")
}

resource "aws_s3_bucket_versioning" "artifacts" {
  bucket = aws_s3_bucket.artifacts.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "artifacts" {
  bucket = aws_s3_bucket.artifacts.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_public_access_block" "artifacts" {
  bucket                  = aws_s3_bucket.artifacts.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

# JoyNexus deletes checkpoints beyond JOYNEXUS_CHECKPOINT_KEEP_LAST itself; on a versioned bucket
# those deletions leave noncurrent versions, which expire here. Checkpoints still current (pinned
# registered versions) move to STANDARD_IA once they are old. Failed multipart uploads go after 7 days.
resource "aws_s3_bucket_lifecycle_configuration" "artifacts" {
  bucket = aws_s3_bucket.artifacts.id

  rule {
    id     = "old-checkpoints"
    status = "Enabled"
    filter {
      prefix = "checkpoints/"
    }
    transition {
      days          = var.checkpoint_lifecycle.infrequent_access_days
      storage_class = "STANDARD_IA"
    }
    noncurrent_version_expiration {
      noncurrent_days = var.checkpoint_lifecycle.noncurrent_days
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  rule {
    id     = "noncurrent-elsewhere"
    status = "Enabled"
    filter {}
    noncurrent_version_expiration {
      noncurrent_days = 90
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  depends_on = [aws_s3_bucket_versioning.artifacts]
}

# Only TLS requests reach the bucket.
data "aws_iam_policy_document" "artifacts_tls" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.artifacts.arn, "${aws_s3_bucket.artifacts.arn}/*"]
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

resource "aws_s3_bucket_policy" "artifacts" {
  bucket     = aws_s3_bucket.artifacts.id
  policy     = data.aws_iam_policy_document.artifacts_tls.json
  depends_on = [aws_s3_bucket_public_access_block.artifacts]
}
