"""One real Kubernetes node on this machine: containerd v2 (with its runc
shim and Debian's runc) and the kubelet, both built from the modules pinned
in upstream/, joined to a ControlPlane with the node's own identity.

The kubelet's device-plugin socket is fixed at /var/lib/kubelet/device-plugins
(k8s.io/kubelet pkg/apis/deviceplugin/v1beta1 constants.go), so the node runs
in a mount namespace of its own where /var/lib/kubelet is the test's folder:
a holder process makes it, and containerd and the kubelet enter it, so the
paths the kubelet hands containerd are the same for both. Everything else
(containerd's root, state, runc's root, network namespaces, CNI state, pod
logs) lives under the folder. The daemon under test, outside the namespace,
reaches the same sockets through the folder itself.

Made for this sandbox: cgroup v1 (the kubelet's failCgroupV1 off), no QoS
cgroups, no CAP_SYS_RESOURCE (containerd keeps oom_score_adj at its own),
no registry (images built here as OCI archives and imported; the pause image
is pinned so nothing is ever pulled).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from devplugin.node.kubelet_facts import cpulist
from devplugin.testing.controlplane import (
    ControlPlane,
    Process,
    build_pin,
    free_port,
    kubeconfig,
)
from devplugin.testing.node import write_numa_nodes
from devplugin.testing.oci_image import PAUSE_IMAGE, WORK_IMAGE, write_image

KUBELET_DIR = Path("/var/lib/kubelet")
SYS_NODES = Path("/sys/devices/system/node")
RUNC = "/usr/sbin/runc"
CNI_BIN = Path("/usr/lib/cni")


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    containerd: Path  # the folder with containerd, containerd-shim-runc-v2, ctr


def missing() -> str | None:
    """Why this machine cannot run a real node, or None."""
    if os.geteuid() != 0:
        return "real-node tier: needs root (containerd, mount namespaces, mknod)"
    if shutil.which("go") is None:
        return "real-node tier: Go is not installed, the kubelet and containerd cannot be built"
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"real-node tier: {tool} (util-linux) is missing"
    if not Path(RUNC).exists():
        return f"real-node tier: {RUNC} is missing (Debian's runc)"
    if not (CNI_BIN / "ptp").exists():
        return f"real-node tier: {CNI_BIN}/ptp is missing (containernetworking-plugins)"
    return None


def node_binaries(minor: str) -> NodeBinaries:
    """The kubelet of a pinned Kubernetes minor and the pinned containerd,
    built now where the cache lacks them."""
    return NodeBinaries(build_pin(minor) / "kubelet", build_pin("containerd"))


@dataclass
class RealNode:
    """A kubelet and containerd on this machine; `start()` returns once the
    Node is Ready. The folder must be short: unix socket paths under it are
    limited to 107 bytes."""

    plane: ControlPlane
    bins: NodeBinaries
    folder: Path
    name: str
    cdi_dir: Path
    processes: dict[str, Process] = field(default_factory=dict)
    # KubeletConfiguration fields set over the tier's own (the Topology and
    # CPU Managers, say).
    kubelet_settings: dict[str, Any] = field(default_factory=dict)
    # NUMA node -> its CPUs (cpulist form) as the kubelet is to see the
    # machine: its /sys/devices/system/node made so inside the node's mount
    # namespace (None: the machine's own).
    numa: dict[int, str] | None = None

    def __post_init__(self) -> None:
        # A second folder of CDI specs, as /var/run/cdi is beside /etc/cdi:
        # what a daemon in a pod writes (the chart mounts the two apart).
        self.cdi_dynamic = self.cdi_dir.with_name(self.cdi_dir.name + "-dynamic")
        self.kubelet_dir = self.folder / "kubelet"
        self.socket = self.folder / "containerd.sock"
        self.logs = self.folder / "logs"
        self.kubelet_port = free_port()
        self.healthz_port = free_port()

    # -- where the daemon meets it
    @property
    def device_plugin_dir(self) -> Path:
        return self.kubelet_dir / "device-plugins"

    @property
    def pod_resources_socket(self) -> Path:
        return self.kubelet_dir / "pod-resources" / "kubelet.sock"

    @property
    def plugins_dir(self) -> Path:
        """Where DRA drivers put their sockets (the kubelet's plugins folder)."""
        return self.kubelet_dir / "plugins"

    @property
    def registry_dir(self) -> Path:
        """The kubelet's plugin watcher's folder (DRA drivers register there)."""
        return self.kubelet_dir / "plugins_registry"

    # -- lifecycle
    def start(self, within: float = 60.0) -> RealNode:
        try:
            for sub in ("kubelet", "containerd", "cni", "cni-state", "logs", "runc"):
                (self.folder / sub).mkdir(parents=True, exist_ok=True)
            self.cdi_dir.mkdir(parents=True, exist_ok=True)
            self.cdi_dynamic.mkdir(parents=True, exist_ok=True)
            KUBELET_DIR.mkdir(parents=True, exist_ok=True)  # the mount point
            self._holder()
            self._containerd(within)
            self._import_images()
            self.start_kubelet()
            if not self.wait_ready(within):
                raise RuntimeError(f"the Node did not become Ready:\n{self.tail('kubelet')}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for name in ("kubelet", "containerd"):
            if name in self.processes:
                self.processes.pop(name).stop()
        self._remove_containers()
        if "holder" in self.processes:
            self.processes.pop("holder").stop()

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def tail(self, name: str, lines: int = 30) -> str:
        process = self.processes.get(name)
        return process.tail(lines) if process is not None else ""

    # -- the processes
    def _spawn(self, name: str, command: list[str], env: dict[str, str] | None = None) -> Process:
        log = self.folder / f"{name}.log"
        handle = log.open("ab")
        popen = subprocess.Popen(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            cwd=self.folder,
            start_new_session=True,
            env=env,
        )
        process = Process(name, popen, log, handle)
        self.processes[name] = process
        return process

    def _enter(self) -> list[str]:
        holder = self.processes["holder"].popen.pid
        return ["nsenter", f"--target={holder}", "--mount", "--"]

    def _holder(self) -> None:
        # A private mount namespace whose /var/lib/kubelet is the folder's;
        # it lives as long as this process sleeps.
        script = f"mount --bind {self.kubelet_dir} {KUBELET_DIR}"
        if self.numa is not None:
            script += f" && mount --bind {self._numa_tree()} {SYS_NODES}"
        script += " && exec sleep 2147483647"
        holder = self._spawn(
            "holder", ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        )
        deadline = time.monotonic() + 10
        probe = self.kubelet_dir / ".holder-probe"
        probe.touch()
        while True:
            seen = subprocess.run(
                [*self._enter(), "test", "-e", str(KUBELET_DIR / ".holder-probe")], check=False
            )
            if seen.returncode == 0:
                return
            if holder.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the node's mount namespace failed:\n{holder.tail()}")
            time.sleep(0.05)

    def _numa_tree(self) -> Path:
        """/sys/devices/system/node as the kubelet's cadvisor reads it
        (google/cadvisor utils/sysinfo: node*/cpu* links to the CPUs' own
        folders, each node's meminfo and distance), with the machine's real
        CPUs split among the nodes `numa` names."""
        assert self.numa is not None
        tree = self.folder / "sys-node"
        write_numa_nodes(tree.parent / "sys-fake", self.numa)
        built = tree.parent / "sys-fake" / "devices" / "system" / "node"
        if tree.exists():
            shutil.rmtree(tree)
        built.rename(tree)
        shutil.rmtree(tree.parent / "sys-fake")
        total_kib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024
        share = total_kib // max(1, len(self.numa))
        ids = sorted(self.numa)
        for node in ids:
            folder = tree / f"node{node}"
            for cpu in sorted(cpulist(self.numa[node])):
                (folder / f"cpu{cpu}").symlink_to(f"/sys/devices/system/cpu/cpu{cpu}")
            (folder / "meminfo").write_text(
                f"Node {node} MemTotal: {share} kB\nNode {node} MemFree: {share} kB\n"
            )
            (folder / "distance").write_text(
                " ".join("10" if other == node else "20" for other in ids) + "\n"
            )
        (tree / "online").write_text(f"{ids[0]}-{ids[-1]}\n")
        return tree

    def _containerd_config(self) -> Path:
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        images = "plugins.'io.containerd.cri.v1.images'"
        text = f"""version = 3
root = "{self.folder}/containerd/root"
state = "{self.folder}/containerd/state"
[grpc]
  address = "{self.socket}"
[{runtime}]
  cdi_spec_dirs = ["{self.cdi_dir}", "{self.cdi_dynamic}"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [{runtime}.containerd]
    default_runtime_name = "runc"
    [{runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{runtime}.containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        Root = "{self.folder}/runc"
        SystemdCgroup = false
  [{runtime}.cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{self.folder}/cni"
[{images}]
  snapshotter = "overlayfs"
  [{images}.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
"""
        # Why each setting: restrict_oom_score_adj because this sandbox has no
        # CAP_SYS_RESOURCE (runc fails "can't get final child's PID" on -998);
        # the pinned sandbox image because no registry is reachable.
        path = self.folder / "containerd.toml"
        path.write_text(text)
        network = {
            "cniVersion": "1.0.0",
            "name": "devplugin-node",
            "plugins": [
                {
                    "type": "ptp",
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": "10.244.0.0/24"}]],
                        "dataDir": str(self.folder / "cni-state"),
                    },
                }
            ],
        }
        (self.folder / "cni" / "10-devplugin.conflist").write_text(json.dumps(network))
        return path

    def _ctr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                *self._enter(),
                str(self.bins.containerd / "ctr"),
                "--address",
                str(self.socket),
                "--namespace",
                "k8s.io",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _containerd(self, within: float) -> None:
        config = self._containerd_config()
        env = dict(os.environ, PATH=f"{self.bins.containerd}:{os.environ.get('PATH', '')}")
        process = self._spawn(
            "containerd",
            [*self._enter(), str(self.bins.containerd / "containerd"), "--config", str(config)],
            env=env,
        )
        deadline = time.monotonic() + within
        while self._ctr("version").returncode != 0:
            if process.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start:\n{process.tail()}")
            time.sleep(0.1)

    def _import_images(self) -> None:
        for ref, entrypoint in ((PAUSE_IMAGE, ["/bin/sleep", "2147483647"]), (WORK_IMAGE, None)):
            archive = self.folder / (ref.rsplit("/", 1)[-1].replace(":", "-") + ".tar")
            write_image(archive, ref, entrypoint)
            done = self._ctr("images", "import", str(archive), timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"ctr images import {ref}: {done.stderr[-600:]}")

    def import_image(self, archive: Path) -> None:
        """An OCI image archive (one a build saved) into the node's containerd."""
        done = self._ctr("images", "import", str(archive), timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"ctr images import {archive.name}: {done.stderr[-600:]}")

    def images(self) -> list[str]:
        """The image references the node's containerd holds."""
        return self._ctr("images", "list", "-q").stdout.split()

    def _kubelet_config(self) -> Path:
        cert = self.plane.pki.issue(self.name, f"system:node:{self.name}", ["system:nodes"])
        config_file = self.folder / "kubelet.kubeconfig"
        config_file.write_text(
            yaml.safe_dump(kubeconfig(self.plane.server, self.plane.pki.ca, cert=cert))
        )
        settings: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.plane.pki.ca)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "address": "127.0.0.1",
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            # This machine: cgroup v1 in a container, swap unknown, no QoS tree.
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "failSwapOn": False,
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "localStorageCapacityIsolation": False,
            # The disk is shared with everything else on the machine: never evict.
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "resolvConf": "",
            "podLogsDir": str(self.logs),
            "nodeStatusUpdateFrequency": "1s",
            "syncFrequency": "2s",
            **self.kubelet_settings,
        }
        path = self.folder / "kubelet.yaml"
        path.write_text(yaml.safe_dump(settings))
        return config_file

    def start_kubelet(self) -> None:
        kubeconfig_file = self._kubelet_config()
        self._spawn(
            "kubelet",
            [
                *self._enter(),
                str(self.bins.kubelet),
                "--config",
                str(self.folder / "kubelet.yaml"),
                "--kubeconfig",
                str(kubeconfig_file),
                "--root-dir",
                str(KUBELET_DIR),
                "--hostname-override",
                self.name,
                "--v",
                "2",
            ],
        )

    def stop_kubelet(self) -> None:
        if "kubelet" in self.processes:
            self.processes.pop("kubelet").stop()

    def _remove_containers(self) -> None:
        # runc's containers outlive containerd: stop them, as a node's
        # shutdown would, so no test leaves a process behind. The shim gives
        # runc a root per containerd namespace (Root joined with the
        # namespace: containerd-shim-runc-v2/process/init.go, NewRunc).
        base = self.folder / "runc"
        roots = [path for path in base.iterdir() if path.is_dir()] if base.exists() else []
        for root in roots:
            self._remove_runc_containers(root)
        for shim in subprocess.run(
            ["pgrep", "-f", f"containerd-shim-runc-v2 .*-address {self.socket}"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(shim), signal.SIGKILL)

    def _remove_runc_containers(self, root: Path) -> None:
        listed = subprocess.run(
            [RUNC, "--root", str(root), "list", "-q"], capture_output=True, text=True, check=False
        )
        for container in listed.stdout.split():
            subprocess.run(
                [RUNC, "--root", str(root), "kill", container, str(int(signal.SIGKILL))],
                capture_output=True,
                check=False,
            )
            subprocess.run(
                [RUNC, "--root", str(root), "delete", "--force", container],
                capture_output=True,
                check=False,
            )

    # -- what the node shows
    def node(self) -> dict[str, Any]:
        found: dict[str, Any] = self.plane.request("GET", f"/api/v1/nodes/{self.name}")
        return found

    def ready(self) -> bool:
        try:
            conditions = self.node().get("status", {}).get("conditions", [])
        except Exception:  # noqa: BLE001 - not registered yet
            return False
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def wait_ready(self, within: float) -> bool:
        deadline = time.monotonic() + within
        while not self.ready():
            kubelet = self.processes.get("kubelet")
            if kubelet is not None and kubelet.popen.poll() is not None:
                return False
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        """What a container wrote (the kubelet's CRI log lines, stream and
        flags stripped); empty while there is none."""
        lines = []
        for path in sorted(self.logs.glob(f"{namespace}_{pod}_*/{container}/*.log")):
            for line in path.read_text(errors="replace").splitlines():
                parts = line.split(" ", 3)
                if len(parts) == 4:
                    lines.append(parts[3])
        return "\n".join(lines)
