variable "region" {
  description = "AWS region of the cluster and the artifact bucket."
  type        = string
  default     = "us-east-1"
}

variable "tags" {
  description = "Extra tags on every AWS resource."
  type        = map(string)
  default     = {}
}

variable "namespace" {
  description = "Kubernetes namespace of JoyNexus (deployments/kustomization.yaml); the per-pod IAM roles are bound to its service accounts."
  type        = string
  default     = "joynexus"
}

variable "cluster" {
  description = "The EKS cluster and its network. The API endpoint is private unless public_endpoint is set, and then open only to public_access_cidrs."
  type = object({
    name                = optional(string, "joynexus")
    kubernetes_version  = optional(string, "1.35")
    vpc_cidr            = optional(string, "10.42.0.0/16")
    availability_zones  = optional(number, 2)
    public_endpoint     = optional(bool, false)
    public_access_cidrs = optional(list(string), [])
  })
  default = {}
}

# tests/deploy/test_node_fit.py reads the instance_types defaults below and checks that every pod of
# the rendered manifests fits the node group it is scheduled on.
variable "node_pools" {
  description = "System (CPU) pool for the API, Prefect, MLflow, the Ray head and cluster add-ons; GPU pool for the Ray training and inference workers; CPU pool for the Ray environment workers (simulators). min/max bound the cluster-autoscaler."
  type = object({
    system = optional(object({
      instance_types = optional(list(string), ["m6i.xlarge"])
      min_size       = optional(number, 2)
      desired_size   = optional(number, 2)
      max_size       = optional(number, 4)
      disk_gib       = optional(number, 100)
    }), {})
    gpu = optional(object({
      instance_types = optional(list(string), ["g5.2xlarge"])
      min_size       = optional(number, 2)
      desired_size   = optional(number, 2)
      max_size       = optional(number, 4)
      disk_gib       = optional(number, 200)
      capacity_type  = optional(string, "ON_DEMAND")
    }), {})
    cpu = optional(object({
      instance_types = optional(list(string), ["m6i.2xlarge"])
      min_size       = optional(number, 1)
      desired_size   = optional(number, 1)
      max_size       = optional(number, 4)
      disk_gib       = optional(number, 100)
    }), {})
  })
  default = {}
}

variable "artifact_bucket" {
  description = "S3 bucket for checkpoints and MLflow artifacts (JOYNEXUS_S3_BUCKET); null: joynexus-artifacts-<account>."
  type        = string
  default     = null
}

variable "checkpoint_lifecycle" {
  description = "S3 lifecycle of checkpoints/: superseded (noncurrent) objects expire after noncurrent_days; current ones move to STANDARD_IA after infrequent_access_days."
  type = object({
    noncurrent_days        = optional(number, 30)
    infrequent_access_days = optional(number, 60)
  })
  default = {}
}

variable "database" {
  description = "RDS PostgreSQL for the control plane, MLflow and Prefect (one instance, three databases)."
  type = object({
    instance_class        = optional(string, "db.t4g.medium")
    engine_version        = optional(string, "16")
    allocated_storage_gib = optional(number, 50)
    max_storage_gib       = optional(number, 200)
    multi_az              = optional(bool, true)
    backup_retention_days = optional(number, 7)
    deletion_protection   = optional(bool, true)
  })
  default = {}
}

variable "gcs_redis" {
  description = "ElastiCache Redis that makes the Ray head's GCS fault tolerant (the resident services survive a head restart)."
  type = object({
    node_type               = optional(string, "cache.t4g.small")
    snapshot_retention_days = optional(number, 3)
  })
  default = {}
}
