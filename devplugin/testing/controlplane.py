"""A real Kubernetes control plane on loopback, for the cluster tier.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler, built by
upstream/build.sh from the pinned Go modules, each started as its own
process with its own identity: a client certificate signed by a CA made
for the run (the controller manager and scheduler as the bootstrap RBAC
users the API server knows them by), authorized as a production cluster
is: the Node authorizer and NodeRestriction for kubelets, RBAC for the
rest, the default admission chain (ValidatingAdmissionPolicy included),
and API priority and fairness. There is no kubelet: Nodes are
objects whose status the tier writes as a kubelet would, and the node
lifecycle controller waits two hours for a heartbeat before it calls one unreachable.

Everything lives under one folder the tier owns; `stop()` ends every
process it started, whatever part of the start failed.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

REPO = Path(__file__).resolve().parents[2]


class Unavailable(Exception):
    """This machine cannot run the control plane; the message says why."""


@dataclass(frozen=True)
class Binaries:
    folder: Path
    version: str  # v1.35.4

    @property
    def minor(self) -> tuple[int, int]:
        major, minor = self.version.lstrip("v").split(".")[:2]
        return int(major), int(minor)

    def path(self, name: str) -> str:
        return str(self.folder / name)


def build_pin(pin: str) -> Path:
    """The binaries folder of a pin under upstream/ (a Kubernetes minor or
    containerd), built now where the cache lacks it."""
    done = subprocess.run(
        [str(REPO / "upstream" / "build.sh"), pin],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        raise Unavailable(f"upstream/build.sh {pin} failed: {done.stderr.strip()[-400:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def binaries(minor: str) -> Binaries:
    """The built control plane of a pinned minor (`v1.35`): built now when
    Go is here and the cache lacks it; Unavailable where it cannot be."""
    if shutil.which("go") is None:
        raise Unavailable("Go is not installed: the real control plane cannot be built")
    folder = build_pin(minor)
    version = subprocess.run(
        [str(folder / "kube-apiserver"), "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    return Binaries(folder, version)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# -- a CA and the identities it signs ----------------------------------------------


# A new P-256 key, unencrypted, for `openssl req`.
_NEW_EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


class Pki:
    """A CA and the certificates of the run, as files under `folder`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        _openssl(
            "req",
            "-x509",
            *_NEW_EC_KEY,
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=devplugin-cluster-tier-ca",
            cwd=folder,
        )
        # The service-account token signer.
        _openssl(
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-out",
            "sa.key",
            cwd=folder,
        )
        _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    def issue(
        self, name: str, common: str, groups: Sequence[str] = (), *, server: bool = False
    ) -> tuple[Path, Path]:
        """(certificate, key) for a client (CN=user, O=groups) or, with
        `server`, for 127.0.0.1 and localhost."""
        subject = f"/CN={common}" + "".join(f"/O={g}" for g in groups)
        _openssl(
            "req",
            *_NEW_EC_KEY,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            subject,
            cwd=self.folder,
        )
        usage = "serverAuth" if server else "clientAuth"
        extensions = f"extendedKeyUsage={usage}\nkeyUsage=digitalSignature\n"
        if server:
            extensions += "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        (self.folder / f"{name}.ext").write_text(extensions)
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            f"{name}.crt",
            "-extfile",
            f"{name}.ext",
            cwd=self.folder,
        )
        return self.folder / f"{name}.crt", self.folder / f"{name}.key"


def kubeconfig(
    server: str, ca: Path, *, cert: tuple[Path, Path] | None = None, token: str | None = None
) -> dict[str, Any]:
    user: dict[str, Any] = {}
    if cert is not None:
        user = {"client-certificate": str(cert[0]), "client-key": str(cert[1])}
    if token is not None:
        user = {"token": token}
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "tier",
        "clusters": [{"name": "tier", "cluster": {
            "server": server, "certificate-authority-data":
                base64.b64encode(ca.read_bytes()).decode()}}],
        "users": [{"name": "tier", "user": user}],
        "contexts": [{"name": "tier", "context": {"cluster": "tier", "user": "tier"}}],
    }  # fmt: skip


# -- the processes -------------------------------------------------------------------


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    handle: IO[bytes]

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self.handle.close()


@dataclass
class ControlPlane:
    """A started control plane; `admin` is a kubeconfig dict of a cluster
    administrator (system:masters)."""

    bins: Binaries
    folder: Path
    scheduler_config: Mapping[str, Any] | None = None
    feature_gates: Mapping[str, bool] = field(default_factory=dict)
    processes: dict[str, Process] = field(default_factory=dict)
    scheduler_ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pki = Pki(self.folder / "pki")
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        admin = self.pki.issue("admin", "tier-admin", ["system:masters"])
        self.admin = kubeconfig(self.server, self.pki.ca, cert=admin)
        self.admin_file = self._write("admin.kubeconfig", self.admin)

    # -- lifecycle
    def start(self, within: float = 120.0) -> ControlPlane:
        try:
            self._etcd()
            self._apiserver(within)
            self._controller_manager()
            self._controllers_working(within)
            if self.scheduler_config is not None:
                self.start_scheduler(self.scheduler_config)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            self.processes.pop(name).stop()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers
    def _write(self, name: str, document: Mapping[str, Any]) -> Path:
        path = self.folder / name
        path.write_text(yaml.safe_dump(dict(document)))
        return path

    def _spawn(self, name: str, command: Sequence[str]) -> Process:
        log = self.folder / f"{name}.log"
        handle = log.open("ab")
        popen = subprocess.Popen(
            list(command),
            stdout=handle,
            stderr=subprocess.STDOUT,
            cwd=self.folder,
            start_new_session=True,
        )
        process = Process(name, popen, log, handle)
        self.processes[name] = process
        return process

    def _gates(self, *extra: str) -> list[str]:
        gates = [f"{k}={'true' if v else 'false'}" for k, v in sorted(self.feature_gates.items())]
        gates.extend(extra)
        return [f"--feature-gates={','.join(gates)}"] if gates else []

    def _etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        process = self._spawn(
            "etcd",
            [
                self.bins.path("etcd"),
                "--data-dir",
                str(self.folder / "etcd"),
                "--listen-client-urls",
                self.etcd_url,
                "--advertise-client-urls",
                self.etcd_url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
                "--quota-backend-bytes",
                str(2 << 30),
                "--log-level",
                "warn",
            ],
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=1) as answer:
                    if json.loads(answer.read()).get("health") == "true":
                        return
            except OSError:
                pass
            if process.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start:\n{process.tail()}")
            time.sleep(0.1)

    def _apiserver(self, within: float) -> None:
        serving = self.pki.issue("apiserver", "kube-apiserver", server=True)
        self._apiserver_command = [
            self.bins.path("kube-apiserver"),
            "--etcd-servers",
            self.etcd_url,
            "--bind-address",
            "127.0.0.1",
            "--advertise-address",
            "127.0.0.1",
            "--secure-port",
            str(self.port),
            "--tls-cert-file",
            str(serving[0]),
            "--tls-private-key-file",
            str(serving[1]),
            "--client-ca-file",
            str(self.pki.ca),
            "--service-account-issuer",
            "https://kubernetes.default.svc",
            "--service-account-key-file",
            str(self.pki.folder / "sa.pub"),
            "--service-account-signing-key-file",
            str(self.pki.folder / "sa.key"),
            "--api-audiences",
            "https://kubernetes.default.svc",
            "--service-cluster-ip-range",
            "10.96.0.0/16",
            # As a production cluster runs: kubelets authorized by the
            # Node authorizer and held to their own Node and pods by
            # NodeRestriction (on top of the default admission chain),
            # everyone else by RBAC; API priority and fairness on.
            "--authorization-mode",
            "Node,RBAC",
            "--enable-admission-plugins",
            "NodeRestriction",
            "--enable-priority-and-fairness=true",
            "--allow-privileged=true",
            "--profiling=false",
            "--endpoint-reconciler-type",
            "none",
            "--runtime-config",
            "resource.k8s.io/v1=true",
            *self._gates(),
        ]
        self._serve_api(within)

    def _serve_api(self, within: float) -> None:
        process = self._spawn("kube-apiserver", self._apiserver_command)
        deadline = time.monotonic() + within
        while not self.ready():
            if process.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kube-apiserver did not become ready:\n{process.tail()}")
            time.sleep(0.2)

    def restart_apiserver(
        self, *, while_down: Callable[[], None] | None = None, within: float = 120.0
    ) -> None:
        """Stop the API server (SIGTERM: its graceful shutdown ends every
        watch) and start it again on the same port, certificate and etcd, as
        an upgrade or a crash-looping control-plane node does; `while_down`
        runs in between. Returns once it serves again."""
        old = self.processes.pop("kube-apiserver")
        old.stop()
        try:
            if while_down is not None:
                while_down()
        finally:
            self._serve_api(within)

    # -- etcd, behind the API server's back
    def _etcd_call(self, path: str, body: Mapping[str, Any]) -> Any:
        request = urllib.request.Request(
            f"{self.etcd_url}{path}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())

    def etcd_revision(self) -> int:
        """etcd's current revision (the newest resourceVersion any object can have)."""
        found = self._etcd_call("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})
        return int(found["header"]["revision"])

    def compact_etcd(self) -> int:
        """Move etcd past every revision it holds now and compact there, so
        a watch resumed from any resourceVersion handed out before is told
        410 Gone (as after a long outage, or a busy cluster's compaction);
        the revision compacted at. A key outside the API server's prefix
        takes the step, so no object changes."""
        marker = base64.b64encode(b"/devplugin-tier/compaction").decode()
        self._etcd_call("/v3/kv/put", {"key": marker, "value": marker})
        revision = self.etcd_revision()
        self._etcd_call("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    def _controller_manager(self) -> None:
        identity = self.pki.issue("kcm", "system:kube-controller-manager")
        config = self._write("kcm.kubeconfig", kubeconfig(self.server, self.pki.ca, cert=identity))
        self._spawn("kube-controller-manager", [
            self.bins.path("kube-controller-manager"),
            "--kubeconfig", str(config),
            "--authentication-kubeconfig", str(config), "--authorization-kubeconfig", str(config),
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            "--leader-elect=false", "--use-service-account-credentials=true",
            "--service-account-private-key-file", str(self.pki.folder / "sa.key"),
            "--root-ca-file", str(self.pki.ca),
            # The lifecycle controller lifts the not-ready taint admission puts
            # on a new Node once it says Ready; no kubelet renews a heartbeat
            # here, so the grace before it calls a Node unreachable is long.
            "--controllers", "*,-node-ipam-controller", "--node-monitor-grace-period=2h",
            *self._gates(),
        ])  # fmt: skip

    def _controllers_working(self, within: float) -> None:
        """The service-account controller has made `default` its account: the
        controller manager runs (pods can be created from here on)."""
        deadline = time.monotonic() + within
        process = self.processes["kube-controller-manager"]
        while True:
            try:
                self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")
                return
            except (ApiFailure, OSError):
                pass
            if process.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kube-controller-manager is not working:\n{process.tail()}")
            time.sleep(0.2)

    def start_scheduler(self, config: Mapping[str, Any], name: str = "kube-scheduler") -> None:
        """(Re)start a kube-scheduler with a KubeSchedulerConfiguration; its
        kubeconfig and leader election are filled in here. Schedulers of
        other names keep running beside it (each profile's schedulerName
        says which pods are whose)."""
        old = self.processes.pop(name, None)
        if old is not None:
            old.stop()
        identity = self.pki.issue("scheduler", "system:kube-scheduler")
        client = self._write(
            "scheduler.kubeconfig", kubeconfig(self.server, self.pki.ca, cert=identity)
        )
        document = dict(config)
        document["clientConnection"] = {"kubeconfig": str(client), "qps": 500, "burst": 1000}
        document["leaderElection"] = {"leaderElect": False}
        path = self._write(f"{name}.yaml", document)
        port = self.scheduler_ports[name] = free_port()
        self._spawn(name, [
            self.bins.path("kube-scheduler"), "--config", str(path),
            "--authentication-kubeconfig", str(client), "--authorization-kubeconfig", str(client),
            "--bind-address", "127.0.0.1", "--secure-port", str(port),
            "--authorization-always-allow-paths", "/healthz,/readyz,/livez,/metrics",
            *self._gates(),
        ])  # fmt: skip
        deadline = time.monotonic() + 60
        while not self.scheduler_ready(name):
            process = self.processes[name]
            if process.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not become ready:\n{process.tail()}")
            time.sleep(0.1)

    def stop_scheduler(self, name: str = "kube-scheduler") -> None:
        process = self.processes.pop(name, None)
        if process is not None:
            process.stop()

    def scheduler_metrics(self, name: str = "kube-scheduler") -> str:
        """A running kube-scheduler's /metrics text (an always-allowed path
        on its secure port, whose certificate it made itself)."""
        url = f"https://127.0.0.1:{self.scheduler_ports[name]}/metrics"
        with urllib.request.urlopen(url, context=_unverified(), timeout=30) as answer:
            return str(answer.read().decode())

    def scheduler_ready(self, name: str = "kube-scheduler") -> bool:
        try:
            url = f"https://127.0.0.1:{self.scheduler_ports[name]}/readyz"
            with urllib.request.urlopen(url, context=_unverified(), timeout=5) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    # -- asking the API server
    def ready(self) -> bool:
        try:
            return bool(self.request("GET", "/readyz", raw=True) == b"ok")
        except (OSError, ApiFailure):
            return False

    def context(self) -> ssl.SSLContext:
        """TLS as the administrator: the run's CA trusted, the admin's
        client certificate presented."""
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        folder = self.pki.folder
        context.load_cert_chain(str(folder / "admin.crt"), str(folder / "admin.key"))
        return context

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bool = False,
        content_type: str = "application/json",
        token: str | None = None,
    ) -> Any:
        """One request as the administrator (or with a bearer token)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.server}{path}",
            data=data,
            method=method,
            headers={"Content-Type": content_type, "Accept": "application/json"},
        )
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        if token is None:
            context = self.context()
        else:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as answer:
                payload = answer.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            raise ApiFailure(exc.code, text) from exc
        return payload if raw else json.loads(payload or b"null")

    def apply(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> Any:
        """Create an object (or replace it where it exists), as kubectl
        apply would for a first install: server-side apply."""
        path = object_path(obj)
        query = "?fieldManager=tier&force=true" + ("&dryRun=All" if dry_run else "")
        return self.request("PATCH", path + query, obj, content_type="application/apply-patch+yaml")

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        done = subprocess.run(
            [self.bins.path("kubectl"), "--kubeconfig", str(self.admin_file), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise ApiFailure(done.returncode, done.stderr.strip())
        return done.stdout


def _unverified() -> ssl.SSLContext:
    # The scheduler serves with a certificate it made itself at start; on
    # loopback, for its metrics, there is nothing to verify it against.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


class ApiFailure(Exception):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{code}: {text[:2000]}")
        self.code = code
        self.text = text


# Resources whose objects live in a namespace (what the tier writes).
_CLUSTER_SCOPED = {
    "Namespace", "Node", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
    "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "DeviceClass",
    "ResourceSlice", "PriorityClass", "NodeDevices",
}  # fmt: skip


def _plural(kind: str) -> str:
    lower = kind.lower()
    if lower.endswith("ss"):
        return lower + "es"
    if lower.endswith("y"):
        return lower[:-1] + "ies"
    return lower + ("es" if lower.endswith("s") else "s")


def object_path(obj: Mapping[str, Any]) -> str:
    version = obj["apiVersion"]
    base = f"/api/{version}" if "/" not in version else f"/apis/{version}"
    meta = obj["metadata"]
    plural = _plural(obj["kind"])
    if obj["kind"] in _CLUSTER_SCOPED:
        return f"{base}/{plural}/{meta['name']}"
    namespace = meta.get("namespace") or "default"
    return f"{base}/namespaces/{namespace}/{plural}/{meta['name']}"


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false")
