"""The kubelet's Device Plugin API (v1beta1): one DevicePlugin server per
resource on its own unix socket, registration and re-registration with the
kubelet, and the PodResources client the node's holdings read."""
