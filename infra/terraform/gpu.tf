# GPU nodes run the EKS accelerated AMI (drivers installed); the device plugin advertises their
# GPUs to the scheduler as nvidia.com/gpu, which the Ray worker pods request.
resource "helm_release" "nvidia_device_plugin" {
  name             = "nvidia-device-plugin"
  repository       = "https://nvidia.github.io/k8s-device-plugin"
  chart            = "nvidia-device-plugin"
  version          = var.nvidia_device_plugin.chart_version
  namespace        = var.nvidia_device_plugin.namespace
  create_namespace = true
  atomic           = true

  values = [file("${path.module}/values/nvidia-device-plugin.yaml")]

  depends_on = [module.eks_gpu]
}
