"""Just enough of a Kubernetes API server for `helm install` to run for real.

Helm's install checks that the cluster is reachable and asks it which APIs
exist before it renders a chart, then stores its release as a Secret and
creates each rendered object. This server answers those calls, keeps every
object it is sent, and serves them back, so a test can run the real Helm
engine (helm-sdkpy) and inspect exactly what the chart rendered.

Helm must use its in-memory release store (HELM_DRIVER=memory): its Secret
store talks protobuf, which this server does not read. Every object received
is listed by `GET /_objects`.
"""

from __future__ import annotations

import json
import sys
import threading
import uuid
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlparse

# group/version -> [(resource, kind, namespaced)]
RESOURCES: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [
        ("configmaps", "ConfigMap", True),
        ("secrets", "Secret", True),
        ("services", "Service", True),
        ("serviceaccounts", "ServiceAccount", True),
        ("pods", "Pod", True),
        ("namespaces", "Namespace", False),
    ],
    "apps/v1": [("daemonsets", "DaemonSet", True), ("deployments", "Deployment", True)],
    "monitoring.coreos.com/v1": [
        ("servicemonitors", "ServiceMonitor", True),
        ("prometheusrules", "PrometheusRule", True),
    ],
    "rbac.authorization.k8s.io/v1": [
        ("roles", "Role", True),
        ("rolebindings", "RoleBinding", True),
        ("clusterroles", "ClusterRole", False),
        ("clusterrolebindings", "ClusterRoleBinding", False),
    ],
    "scheduling.k8s.io/v1": [("priorityclasses", "PriorityClass", False)],
    "apiextensions.k8s.io/v1": [
        ("customresourcedefinitions", "CustomResourceDefinition", False),
    ],
    "resource.k8s.io/v1": [
        ("deviceclasses", "DeviceClass", False),
        ("resourceclaimtemplates", "ResourceClaimTemplate", True),
        ("resourceclaims", "ResourceClaim", True),
        ("resourceslices", "ResourceSlice", False),
    ],
    "admissionregistration.k8s.io/v1": [
        ("validatingadmissionpolicies", "ValidatingAdmissionPolicy", False),
        ("validatingadmissionpolicybindings", "ValidatingAdmissionPolicyBinding", False),
    ],
}
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


class Store:
    """What the server holds, and which cluster it plays: its version (what
    `.Capabilities.KubeVersion` becomes) and the group/versions it serves
    (`.Capabilities.APIVersions`)."""

    def __init__(self, kube_version: str = "v1.31.0", without: Sequence[str] = ()) -> None:
        self.lock = threading.Lock()
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.version = 1
        self.kube_version = kube_version
        self.served = {gv: kinds for gv, kinds in RESOURCES.items() if gv not in without}


def resource_list(group_version: str) -> dict[str, Any]:
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": [
            {"name": name, "singularName": kind.lower(), "namespaced": namespaced,
             "kind": kind, "verbs": VERBS}
            for name, kind, namespaced in RESOURCES[group_version]
        ],
    }  # fmt: skip


def group_list(served: Sequence[str]) -> dict[str, Any]:
    groups = []
    for group_version in served:
        if "/" not in group_version:
            continue
        group, version = group_version.split("/")
        entry = {"groupVersion": group_version, "version": version}
        groups.append({"name": group, "versions": [entry], "preferredVersion": entry})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "reason": reason, "message": message, "code": code}  # fmt: skip


class FakeApiHandler(BaseHTTPRequestHandler):
    """What `make_handler` serves a store with."""

    protocol_version = "HTTP/1.1"
    # The head and the body go out in two writes: with Nagle on, the body
    # waits for Helm's delayed ACK, 40 ms on every call.
    disable_nagle_algorithm = True
    store: ClassVar[Store]

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _reply(self, code: int, body: dict[str, Any] | list[Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}") if length else {}

    def _route(self) -> tuple[str, str | None, str, str | None] | None:
        """(group/version, namespace, resource, name) of an object path."""
        parts = [p for p in urlparse(self.path).path.split("/") if p]
        if parts[:1] == ["api"] and len(parts) >= 3:
            group_version, rest = parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 4:
            group_version, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        else:
            return None
        namespace = None
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        if not rest or group_version not in self.store.served:
            return None
        return group_version, namespace, rest[0], rest[1] if len(rest) > 1 else None

    def _kind(self, group_version: str, resource: str) -> str:
        for name, kind, _ in RESOURCES.get(group_version, []):
            if name == resource:
                return kind
        return resource

    def do_GET(self) -> None:
        path = urlparse(self.path).path.rstrip("/")
        if path == "/version":
            major, minor = self.store.kube_version.lstrip("v").split(".")[:2]
            return self._reply(
                200,
                {
                    "major": major,
                    "minor": minor,
                    "gitVersion": self.store.kube_version,
                    "platform": "linux/amd64",
                },
            )
        if path == "/api":
            return self._reply(
                200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
            )
        if path == "/apis":
            return self._reply(200, group_list(list(self.store.served)))
        if path == "/api/v1":
            return self._reply(200, resource_list("v1"))
        if path.startswith("/apis/") and path.count("/") == 3:
            group_version = path[len("/apis/") :]
            if group_version in self.store.served:
                return self._reply(200, resource_list(group_version))
        if path == "/_objects":
            with self.store.lock:
                return self._reply(200, list(self.store.objects.values()))
        route = self._route()
        if route is None:
            return self._reply(404, status(404, "NotFound", f"no route {path}"))
        group_version, namespace, resource, name = route
        with self.store.lock:
            if name is not None:
                found = self.store.objects.get((group_version, namespace or "", resource, name))
                if found is None:
                    missing = status(404, "NotFound", f"{resource} {name} not found")
                    return self._reply(404, missing)
                return self._reply(200, found)
            query = parse_qs(urlparse(self.path).query)
            wanted = dict(
                pair.split("=", 1)
                for pair in query.get("labelSelector", [""])[0].split(",")
                if "=" in pair
            )
            items = [
                obj
                for (gv, ns, res, _), obj in self.store.objects.items()
                if gv == group_version
                and res == resource
                and (namespace is None or ns == namespace)
                and all(obj["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
            ]
        return self._reply(
            200,
            {
                "kind": self._kind(group_version, resource) + "List",
                "apiVersion": group_version,
                "metadata": {"resourceVersion": str(self.store.version)},
                "items": items,
            },
        )

    def _write(self, create: bool) -> None:
        route = self._route()
        if route is None:
            return self._reply(404, status(404, "NotFound", self.path))
        group_version, namespace, resource, name = route
        body = self._body()
        meta = body.setdefault("metadata", {})
        name = name or meta.get("name")
        if namespace:
            meta["namespace"] = namespace
        key = (group_version, namespace or "", resource, name or "")
        with self.store.lock:
            if create and key in self.store.objects:
                exists = status(409, "AlreadyExists", f"{resource} {name} exists")
                return self._reply(409, exists)
            self.store.version += 1
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = str(self.store.version)
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            self.store.objects[key] = body
        self._reply(201 if create else 200, body)

    def do_POST(self) -> None:
        self._write(create=True)

    def do_PUT(self) -> None:
        self._write(create=False)

    def do_PATCH(self) -> None:
        route = self._route()
        if route is None:
            return self._reply(404, status(404, "NotFound", self.path))
        group_version, namespace, resource, name = route
        self._body()
        with self.store.lock:
            found = self.store.objects.get((group_version, namespace or "", resource, name or ""))
        if found is None:
            return self._reply(404, status(404, "NotFound", f"{resource} {name} not found"))
        self._reply(200, found)

    def do_DELETE(self) -> None:
        route = self._route()
        if route is None:
            return self._reply(404, status(404, "NotFound", self.path))
        group_version, namespace, resource, name = route
        with self.store.lock:
            found = self.store.objects.pop(
                (group_version, namespace or "", resource, name or ""), None
            )
        if found is None:
            return self._reply(404, status(404, "NotFound", f"{resource} {name} not found"))
        self._reply(200, found)


def make_handler(store: Store) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (FakeApiHandler,), {"store": store})


def serve(
    port: int = 0, kube_version: str = "v1.31.0", without: Sequence[str] = ()
) -> tuple[ThreadingHTTPServer, Store]:
    store = Store(kube_version, without)
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(store))
    server.daemon_threads = True
    # A short poll: each case shuts its server down, and shutdown waits a poll.
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    ).start()
    return server, store


if __name__ == "__main__":
    server, _ = serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    print(server.server_address[1], flush=True)
    threading.Event().wait()
