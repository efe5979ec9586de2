variable "cluster_name" {
  description = "EKS cluster name; also prefixes the VPC, roles and node groups."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,38}$", var.cluster_name))
    error_message = "cluster_name: 2-39 characters of a-z, 0-9 and '-', starting with a letter."
  }
}

variable "kubernetes_version" {
  description = "EKS Kubernetes version."
  type        = string
  default     = "1.31"
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
  description = "Whether the Kubernetes API is reachable from the internet (it is always reachable from the VPC)."
  type        = bool
  default     = true
}

variable "system_pool" {
  description = "CPU node group: Prefect, MLflow, the Ray head, the KubeRay operator."
  type = object({
    instance_types = optional(list(string), ["m6i.xlarge"])
    min_size       = optional(number, 2)
    desired_size   = optional(number, 2)
    max_size       = optional(number, 4)
    disk_gib       = optional(number, 100)
  })
  default = {}
}

variable "gpu_pool" {
  description = "GPU node group for the Ray workers (tainted nvidia.com/gpu=true:NoSchedule)."
  type = object({
    instance_types = optional(list(string), ["g5.2xlarge"])
    min_size       = optional(number, 1)
    desired_size   = optional(number, 1)
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
