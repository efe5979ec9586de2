provider "aws" {
  region = var.region

  default_tags {
    tags = merge({ "app.kubernetes.io/part-of" = "joynexus" }, var.tags)
  }
}
