"""The API client: a service account in a pod, or a kubeconfig file."""

from __future__ import annotations

import logging

import httpx2
from lightkube import Client, KubeConfig
from lightkube.core.exceptions import ConfigError as KubeConfigError

from devplugin.config import KubernetesConfig

log = logging.getLogger(__name__)

FIELD_MANAGER = "devplugin"


def make_client(kube: KubernetesConfig) -> Client | None:
    """A client for the configured cluster, or None (with one log line) when
    there is none to be had: the daemon then works from the kubelet alone."""
    try:
        if kube.kubeconfig:
            config = KubeConfig.from_file(kube.kubeconfig)
        else:
            config = KubeConfig.from_service_account()
        return Client(
            config=config,
            field_manager=FIELD_MANAGER,
            timeout=httpx2.Timeout(kube.request_timeout_seconds),
        )
    except (KubeConfigError, OSError, ValueError, KeyError) as exc:
        source = kube.kubeconfig or "the pod's service account"
        log.warning(
            "no Kubernetes API access (%s: %s); working from the kubelet alone",
            source, str(exc)[:200],
        )  # fmt: skip
        return None
