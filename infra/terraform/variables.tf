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

variable "cluster" {
  description = "The EKS cluster and its network."
  type = object({
    name               = optional(string, "joynexus")
    kubernetes_version = optional(string, "1.31")
    vpc_cidr           = optional(string, "10.42.0.0/16")
    availability_zones = optional(number, 2)
    public_endpoint    = optional(bool, true)
  })
  default = {}
}

variable "node_pools" {
  description = "System (CPU) pool for the Prefect/MLflow pods and the Ray head; GPU pool for the Ray workers."
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
      min_size       = optional(number, 1)
      desired_size   = optional(number, 1)
      max_size       = optional(number, 4)
      disk_gib       = optional(number, 200)
      capacity_type  = optional(string, "ON_DEMAND")
    }), {})
  })
  default = {}
}

variable "artifact_bucket" {
  description = "S3 bucket for checkpoints and MLflow artifacts (JOYNEXUS_S3_BUCKET); null: joynexus-artifacts-<account>."
  type        = string
  default     = null
}

variable "kuberay" {
  description = "The KubeRay operator Helm release."
  type = object({
    namespace     = optional(string, "kuberay-system")
    chart_version = optional(string, "1.4.2")
  })
  default = {}
}

variable "nvidia_device_plugin" {
  description = "The NVIDIA device plugin Helm release (advertises nvidia.com/gpu on the GPU nodes)."
  type = object({
    namespace     = optional(string, "nvidia-device-plugin")
    chart_version = optional(string, "0.17.1")
  })
  default = {}
}
