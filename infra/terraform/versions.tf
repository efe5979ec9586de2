terraform {
  required_version = ">= 1.9.0"

  # Only the aws provider: everything inside the cluster (KubeRay operator, NVIDIA device plugin,
  # cluster-autoscaler, storage classes) is plain manifests in infra/cluster/, applied by
  # infra/scripts/bootstrap-cluster. So this root module validates offline against a mirror that
  # holds hashicorp/aws alone (tests/deploy/test_terraform.py).
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "5.100.0"
    }
  }

  # Remote state: copy backend.tf.example to backend.tf (S3 bucket + DynamoDB lock table).
}
