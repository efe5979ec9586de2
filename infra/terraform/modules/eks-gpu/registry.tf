# The two images every pod runs (Dockerfile, scripts/build-images): <registry>/joynexus (CUDA, the
# Ray GPU workers) and <registry>/joynexus-cpu (every other pod), in this account's ECR under the
# cluster's name. infra/scripts/bootstrap-cluster builds and pushes a tag here when ECR lacks it (or
# takes --registry for images pushed elsewhere) and points the manifests at them. The node role's
# AmazonEC2ContainerRegistryReadOnly (iam.tf) pulls them; nothing else needs a credential.
locals {
  images = toset(["joynexus", "joynexus-cpu"])
}

resource "aws_ecr_repository" "image" {
  for_each             = local.images
  name                 = "${var.cluster_name}/${each.key}"
  image_tag_mutability = "IMMUTABLE" # a tag is one build: an upgrade is a new tag, never a re-push

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "KMS"
    kms_key         = aws_kms_key.this.arn
  }
}

# Untagged layers (a failed or superseded push) go after 14 days; tagged releases stay until an
# operator removes them (a running deployment or a rollback may need any of them).
resource "aws_ecr_lifecycle_policy" "image" {
  for_each   = local.images
  repository = aws_ecr_repository.image[each.key].name
  policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "expire untagged images"
      selection    = { tagStatus = "untagged", countType = "sinceImagePushed", countUnit = "days", countNumber = 14 }
      action       = { type = "expire" }
    }]
  })
}
