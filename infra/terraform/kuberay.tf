# The KubeRay operator: it turns deployments/ray/raycluster.yaml into Ray head and worker pods.
resource "helm_release" "kuberay_operator" {
  name             = "kuberay-operator"
  repository       = "https://ray-project.github.io/kuberay-helm/"
  chart            = "kuberay-operator"
  version          = var.kuberay.chart_version
  namespace        = var.kuberay.namespace
  create_namespace = true
  atomic           = true
  timeout          = 600

  values = [file("${path.module}/values/kuberay-operator.yaml")]

  depends_on = [module.eks_gpu]
}
