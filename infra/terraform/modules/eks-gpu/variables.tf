variable "cluster_name" {
  description = "EKS cluster name; also prefixes the VPC, roles, node groups, database and file system."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,38}$", var.cluster_name))
    error_message = "cluster_name: 2-39 characters of a-z, 0-9 and '-', starting with a letter."
  }
}

variable "kubernetes_version" {
  description = "EKS Kubernetes version: one in standard support on the dated table eks-versions.json (default: the newest)."
  type        = string
  default     = "1.35"

  # The table, not a hand-kept list: tests/deploy/test_terraform.py checks the default against its dates.
  validation {
    condition = contains([
      for version, dates in jsondecode(file("${path.module}/eks-versions.json")).versions : version
      if tonumber(replace(dates.standard_support_ends, "-", "")) > tonumber(replace(jsondecode(file("${path.module}/eks-versions.json")).as_of, "-", ""))
    ], var.kubernetes_version)
    error_message = "kubernetes_version: must be an EKS version in standard support on the table modules/eks-gpu/eks-versions.json (as of its as_of date); versions past it cost extended-support fees and stop getting fixes."
  }
}

variable "vpc_cidr" {
  description = "CIDR of the cluster VPC; split into one public and one private subnet per zone."
  type        = string
  default     = "10.42.0.0/16"
}

variable "availability_zones" {
  description = "How many availability zones to spread the subnets over."
  type        = number
  default     = 2

  validation {
    condition     = var.availability_zones >= 2 && var.availability_zones <= 4
    error_message = "availability_zones: EKS needs at least 2; at most 4 here."
  }
}

variable "public_endpoint" {
  description = "Whether the Kubernetes API is reachable from outside the VPC (then only from public_access_cidrs)."
  type        = bool
  default     = false
}

variable "public_access_cidrs" {
  description = "CIDRs allowed to reach a public Kubernetes API endpoint; must be set (and not 0.0.0.0/0) when public_endpoint is true."
  type        = list(string)
  default     = []

  validation {
    condition     = !contains(var.public_access_cidrs, "0.0.0.0/0")
    error_message = "public_access_cidrs: list the operators' networks; 0.0.0.0/0 opens the API to the internet."
  }
}

variable "namespace" {
  description = "Kubernetes namespace whose service accounts get the per-pod IAM roles."
  type        = string
  default     = "joynexus"
}

variable "system_pool" {
  description = "CPU node group: the API, Prefect, MLflow, the Ray head, the KubeRay operator, the cluster-autoscaler."
  type = object({
    instance_types = optional(list(string), ["m6i.xlarge"])
    min_size       = optional(number, 2)
    desired_size   = optional(number, 2)
    max_size       = optional(number, 4)
    disk_gib       = optional(number, 100)
  })
  default = {}
}

variable "cpu_pool" {
  description = "CPU node group for the Ray environment workers (simulators): the KubeRay group environment-workers."
  type = object({
    instance_types = optional(list(string), ["m6i.2xlarge"])
    min_size       = optional(number, 1)
    desired_size   = optional(number, 1)
    max_size       = optional(number, 4)
    disk_gib       = optional(number, 100)
  })
  default = {}
}

variable "gpu_pool" {
  description = "GPU node group for the Ray training and inference workers (tainted nvidia.com/gpu=true:NoSchedule)."
  type = object({
    instance_types = optional(list(string), ["g5.2xlarge"])
    min_size       = optional(number, 2)
    desired_size   = optional(number, 2)
    max_size       = optional(number, 4)
    disk_gib       = optional(number, 200)
    capacity_type  = optional(string, "ON_DEMAND")
  })
  default = {}

  validation {
    condition     = contains(["ON_DEMAND", "SPOT"], var.gpu_pool.capacity_type)
    error_message = "gpu_pool.capacity_type: ON_DEMAND or SPOT."
  }
}

variable "artifact_bucket" {
  description = "S3 bucket name for checkpoints and MLflow artifacts; null: joynexus-artifacts-<account id>."
  type        = string
  default     = null
}

variable "checkpoint_lifecycle" {
  description = "Lifecycle of the bucket's checkpoints/ prefix (days)."
  type = object({
    noncurrent_days        = optional(number, 30)
    infrequent_access_days = optional(number, 60)
  })
  default = {}
}

variable "database" {
  description = "RDS PostgreSQL settings."
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

variable "audit_log_days" {
  description = "How long the CloudTrail data events of the artifact bucket (audit.tf) are kept."
  type        = number
  default     = 365

  validation {
    condition     = var.audit_log_days >= 90
    error_message = "audit_log_days: at least 90 days of artifact access history."
  }
}

variable "gcs_redis" {
  description = "ElastiCache Redis of the Ray GCS fault tolerance (cache.tf)."
  type = object({
    node_type               = optional(string, "cache.t4g.small")
    snapshot_retention_days = optional(number, 3)
  })
  default = {}

  validation {
    condition     = var.gcs_redis.snapshot_retention_days >= 1
    error_message = "gcs_redis.snapshot_retention_days: at least 1, so a lost Redis can be restored."
  }
}
