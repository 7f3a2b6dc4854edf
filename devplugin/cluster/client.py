"""The API client: a service account in a pod, or a kubeconfig file.

Every client goes through `WatchTransport`, which gives watch requests a
read deadline (lightkube reads a watch with none, so a connection that goes
silent without a FIN or RST would block its reader for good) and notes
when the server last answered, which is how a watch cache tells a quiet but
healthy watch (re-opened at every server timeout) from a dead one.
"""

from __future__ import annotations

import copy
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx2
from lightkube import Client, KubeConfig
from lightkube.config.client_adapter import verify_cluster
from lightkube.config.kubeconfig import SingleConfig
from lightkube.core.exceptions import ConfigError as KubeConfigError

from devplugin.config import KubernetesConfig

log = logging.getLogger(__name__)

FIELD_MANAGER = "devplugin"


class Heartbeat:
    """When the API server last answered a request (monotonic seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._at = -math.inf

    def beat(self) -> None:
        now = self._clock()
        with self._lock:
            self._at = now

    @property
    def at(self) -> float:
        with self._lock:
            return self._at


class WatchTransport(httpx2.BaseTransport):
    """Wraps the real transport: watch requests get `watch_read_timeout` as
    their read timeout; every answer's headers beat the heartbeat; closing
    it ends a watch blocked in a read at once (closing a socket does not
    wake a thread blocked reading it; shutting it down does)."""

    def __init__(
        self,
        inner: httpx2.BaseTransport,
        *,
        watch_read_timeout: float | None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self._inner = inner
        self._read_timeout = watch_read_timeout
        self._heartbeat = heartbeat
        self._lock = threading.Lock()
        self._watch_stream: Any = None
        self._closed = False

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        watch = request.url.params.get("watch") in ("true", "1")
        if watch and self._read_timeout is not None:
            timeout = dict(request.extensions.get("timeout") or {})
            timeout["read"] = self._read_timeout
            request.extensions = {**request.extensions, "timeout": timeout}
        response = self._inner.handle_request(request)
        if self._heartbeat is not None:
            self._heartbeat.beat()
        if watch:
            with self._lock:
                self._watch_stream = response.extensions.get("network_stream")
                closed = self._closed
            if closed:
                self._end_watch()
        return response

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._end_watch()
        self._inner.close()

    def _end_watch(self) -> None:
        with self._lock:
            stream, self._watch_stream = self._watch_stream, None
        if stream is None:
            return
        try:
            sock = stream.get_extra_info("socket")
            if isinstance(sock, socket.socket):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone


def make_client(
    kube: KubernetesConfig, *, heartbeat: Heartbeat | None = None, quiet: bool = False
) -> Client | None:
    """A client for the configured cluster, or None (with one log line) when
    there is none to be had: the daemon then works from the kubelet alone.
    Watches through it die after `watch_timeout_seconds + request_timeout_seconds`
    without a byte."""
    try:
        if kube.kubeconfig:
            config = KubeConfig.from_file(kube.kubeconfig)
        else:
            config = KubeConfig.from_service_account()
        found = config.get()
        if found is None or found.user is None:
            raise ValueError("the kubeconfig names no current cluster and user")
        single = _plain_http_unverified(found)
        # The TLS settings lightkube would give its own transport (the
        # cluster's CA, the user's client certificate).
        verify = verify_cluster(single.cluster, found.user, single.abs_file)
        transport = WatchTransport(
            httpx2.HTTPTransport(verify=verify),
            watch_read_timeout=kube.watch_timeout_seconds + kube.request_timeout_seconds,
            heartbeat=heartbeat,
        )
        return Client(
            config=single,
            field_manager=FIELD_MANAGER,
            timeout=httpx2.Timeout(kube.request_timeout_seconds),
            transport=transport,
        )
    except (KubeConfigError, OSError, ValueError, KeyError) as exc:
        if not quiet:
            source = kube.kubeconfig or "the pod's service account"
            log.warning(
                "no Kubernetes API access (%s: %s); working from the kubelet alone",
                source,
                str(exc)[:200],
            )
        return None


def _plain_http_unverified(single: SingleConfig) -> SingleConfig:
    """Over plain HTTP no certificate is ever checked, but a verifying TLS
    context is still built for the client (twice: ours and lightkube's), and
    without a CA in the kubeconfig that loads the whole system bundle, 40 ms
    of CPU each. Only an http:// server is marked so; https is untouched."""
    if not single.cluster.server.startswith("http://"):
        return single
    cluster = copy.copy(single.cluster)
    cluster.insecure = True
    return single._replace(cluster=cluster)
