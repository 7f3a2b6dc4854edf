"""Command-line entry points: parse, wire, run. No policy lives here."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from devplugin.config import (
    Config,
    ConfigError,
    check_hooks,
    check_kubernetes,
    check_roots,
    load_config,
    override,
)
from devplugin.logs import setup_logging
from devplugin.node.discovery import Discoverer, NvmlGpuSource, Roots, load_pynvml

log = logging.getLogger("devplugin")

EXIT_CONFIG = 2


class UsageError(Exception):
    """Bad configuration or input: exit 2 with one line."""


def _add_source_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="YAML configuration file (version: v1)")
    parser.add_argument("--sysfs-root", help="sysfs root (default /sys)")
    parser.add_argument("--dev-root", help="device node root (default /dev)")
    parser.add_argument("--nvml-fixture", help="JSON fixture for the built-in fake NVML")
    parser.add_argument("--log-format", choices=["text", "json"], help="log format")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="devplugin",
        description="Kubelet device plugin for GPUs and RDMA HCAs with topology-aware allocation",
    )
    parser.add_argument("--version", action="version", version=f"devplugin {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the device plugin daemon")
    _add_source_flags(run)
    run.add_argument("--device-plugin-dir", help="kubelet device-plugin directory")
    run.add_argument("--pod-resources-socket", help="kubelet PodResources socket")
    run.add_argument(
        "--kubelet-plugins-dir",
        help="kubelet plugins directory; the DRA socket is <dir>/<driver>/dra.sock "
        "(default /var/lib/kubelet/plugins)",
    )
    run.add_argument(
        "--kubelet-registry-dir",
        help="kubelet plugin registry, watched by the kubelet for registration sockets "
        "(default /var/lib/kubelet/plugins_registry)",
    )
    run.add_argument("--checkpoint-file", help="lifecycle checkpoint (in-use devices, cleanups)")
    run.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    run.add_argument("--node-name", help="this node's name (default: $NODE_NAME)")
    run.add_argument(
        "--metrics-address",
        action="append",
        metavar="HOST:PORT",
        help="serve /metrics, /healthz, /readyz here (repeatable; replaces the config's list)",
    )
    discover = commands.add_parser("discover", help="print the GPUs and HCAs found")
    _add_source_flags(discover)
    discover.add_argument("--json", action="store_true", help="print JSON")
    topo = commands.add_parser(
        "topo",
        help="print the GPU/HCA topology matrix, or draw the node's devices",
        description="text: the matrix of this node's GPU/HCA links. dot, svg, png: a picture "
        "of the PCIe tree, NVLinks, GPUs (MIG devices inside), HCAs and their ports, coloured "
        "by health and labelled by holder, from discovery, --daemon, --record or --node.",
    )
    _add_source_flags(topo)
    topo.add_argument("--format", choices=["text", "dot", "svg", "png"], default="text")
    topo.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    topo.add_argument("--record", type=Path, help="draw a NodeDevices record saved as JSON or YAML")
    topo.add_argument("--node", help="draw this node's NodeDevices record from the API server")
    topo.add_argument(
        "--daemon",
        metavar="HOST:PORT",
        help="draw a running daemon's record from its status endpoint (metrics.addresses)",
    )
    topo.add_argument("--kubeconfig", help="with --node: kubeconfig (default: in-cluster)")
    demo = commands.add_parser("demo", help="run the daemon on an embedded simulated node")
    demo.add_argument(
        "--real-node",
        action="store_true",
        help="beside a real kubelet, containerd and control plane built from upstream/ "
        "(root and Go; `make demo-node`)",
    )
    demo.add_argument(
        "--stay", action="store_true", help="with --real-node: keep the node up until Ctrl-C"
    )
    template = commands.add_parser(
        "claim-template",
        help="print a ResourceClaimTemplate for aligned GPUs and HCAs (DRA)",
        description="Each GPU+HCA pair prefers the level given and falls back level by "
        "level (PIX, PXB, PHB, NODE, then anywhere); extra GPUs or HCAs are asked "
        "for without alignment.",
    )
    template.add_argument("--gpus", type=int, required=True, help="GPUs in the claim")
    template.add_argument("--hcas", type=int, required=True, help="HCAs in the claim")
    template.add_argument(
        "--prefer",
        choices=["PIX", "PXB", "PHB", "NODE", "NONE"],
        default="PIX",
        help="the best level each pair asks for first (NONE: no alignment)",
    )
    template.add_argument("--nvlink", action="store_true", help="every GPU in one NVLink domain")
    template.add_argument(
        "--mig",
        default="",
        metavar="PROFILE",
        help="MIG devices of this profile (1g.10gb) instead of whole GPUs, paired the same way",
    )
    template.add_argument("--driver", default="devplugin.io", help="the DRA driver name")
    template.add_argument("--name", default="", help="the template's name")
    template.add_argument("--namespace", default="", help="the template's namespace")
    _extender_arguments(commands)
    return parser


def _extender_arguments(commands: Any) -> None:
    extender = commands.add_parser(
        "extender", help="serve the kube-scheduler extender (filter, prioritize)"
    )
    extender.add_argument(
        "--listen",
        default="0.0.0.0:8888",
        metavar="HOST:PORT",
        help="serve the extender verbs, /healthz, /readyz, /metrics here",
    )
    extender.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster)")
    extender.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    extender.add_argument("--tls-key", help="the certificate's private key (PEM)")
    extender.add_argument(
        "--stale-after-seconds",
        type=float,
        default=120.0,
        help="a NodeDevices record older than this is ignored (default 120)",
    )
    extender.add_argument(
        "--watch-timeout-seconds",
        type=float,
        default=30.0,
        help="the API server ends each watch after this long; one silent for this plus "
        "the request timeout is dead and the cache lists again (default 30)",
    )
    extender.add_argument(
        "--request-timeout-seconds",
        type=float,
        default=5.0,
        help="every API request gives up after this long (default 5)",
    )
    extender.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE") or "default",
        help="where the node daemons' heartbeat Leases are (default: $POD_NAMESPACE or default)",
    )
    extender.add_argument(
        "--dra",
        action="store_true",
        help="also serve /scheduler/claims/{filter,prioritize} for pods with ResourceClaims "
        "(watches ResourceClaims, ResourceSlices and DeviceClasses)",
    )
    extender.add_argument(
        "--dra-device-taints",
        choices=["on", "off"],
        default="on",
        help="whether the scheduler honours device taints (the DRADeviceTaints gate: on by "
        "default from 1.36); the predictions follow it (default on)",
    )
    extender.add_argument("--gpu-resource", default="nvidia.com/gpu")
    extender.add_argument("--hca-resource", default="rdma/hca")
    extender.add_argument("--log-format", choices=["text", "json"], default="text")


def resolve_config(args: argparse.Namespace) -> Config:
    """The file's configuration with command-line flags applied on top."""
    try:
        config = load_config(args.config)
        config = override(
            config,
            **{
                "paths.sysfs_root": getattr(args, "sysfs_root", None),
                "paths.dev_root": getattr(args, "dev_root", None),
                "paths.device_plugin_dir": getattr(args, "device_plugin_dir", None),
                "paths.pod_resources_socket": getattr(args, "pod_resources_socket", None),
                "paths.kubelet_plugins_dir": getattr(args, "kubelet_plugins_dir", None),
                "paths.kubelet_registry_dir": getattr(args, "kubelet_registry_dir", None),
                "nvml.fixture": getattr(args, "nvml_fixture", None),
                "lifecycle.checkpoint_file": getattr(args, "checkpoint_file", None),
                "metrics.addresses": getattr(args, "metrics_address", None),
                "logging.format": getattr(args, "log_format", None),
                "kubernetes.kubeconfig": getattr(args, "kubeconfig", None),
                "kubernetes.node_name": getattr(args, "node_name", None),
            },
        )
        check_roots(config)
        if args.command == "run":
            config = _api_from_flags(args, config)
            check_hooks(config)
            check_kubernetes(config)
    except ConfigError as exc:
        raise UsageError(f"config error: {exc}") from exc
    return config


API_FLAGS = ("kubeconfig", "node_name")


def _api_from_flags(args: argparse.Namespace, config: Config) -> Config:
    """A flag that only means something with API access turns it on (the
    chart turns it on with `kubernetes.enabled`)."""
    given = [f"--{flag.replace('_', '-')}" for flag in API_FLAGS if getattr(args, flag, None)]
    args.api_by_flags = ""
    if given and not config.kubernetes.enabled:
        args.api_by_flags = " and ".join(given)
        return override(config, **{"kubernetes.enabled": True})
    return config


def nvml_library(config: Config) -> Any | None:
    """The fake NVML for a fixture, else the real bindings (None if GPUs are off)."""
    if not config.resources.gpu.enabled:
        return None
    if config.nvml.fixture is not None:
        # The fake is a testing tool: imported only when a fixture is asked for.
        from devplugin.testing.fake_nvml import FakeNvml, FixtureError

        try:
            return FakeNvml.from_file(Path(config.nvml.fixture))
        except FixtureError as exc:
            raise UsageError(f"config error: nvml.fixture: {exc}") from exc
    try:
        return load_pynvml()
    except ImportError as exc:  # pragma: no cover - it is a dependency
        log.error("cannot import pynvml (nvidia-ml-py): %s; GPUs will not be served", exc)
        return None


def _version() -> str:
    """The installed distribution's version (an image says which it runs)."""
    try:
        return importlib.metadata.version("devplugin")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _scan(config: Config) -> Any:
    lib = nvml_library(config)
    discoverer = Discoverer(
        Roots(Path(config.paths.sysfs_root), Path(config.paths.dev_root)),
        NvmlGpuSource(lib) if lib is not None else None,
        mig_strategy=config.resources.gpu.mig.strategy,
        caps_root=Path(config.paths.nvidia_caps_root),
    )
    try:
        return discoverer.scan()
    finally:
        discoverer.close()


def _stop_on_signals() -> threading.Event:
    """An event SIGTERM and SIGINT set (with one log line)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def cmd_run(args: argparse.Namespace) -> int:
    from devplugin.runtime import build, settle_heap

    config = resolve_config(args)
    setup_logging(config.logging.format, config.logging.level)
    if getattr(args, "api_by_flags", ""):
        log.info("Kubernetes API access on: %s given on the command line", args.api_by_flags)
    lib = nvml_library(config)
    stop = _stop_on_signals()
    try:
        daemon = build(config, lib)
    except ConfigError as exc:
        raise UsageError(f"config error: {exc}") from exc
    try:
        daemon.start()
    except (OSError, ValueError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        daemon.stop()
        return 1
    settle_heap()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        daemon.stop()
    return 0


def cmd_discover(args: argparse.Namespace) -> int:
    from devplugin.node.report import inventory_dict, inventory_text

    config = resolve_config(args)
    setup_logging(config.logging.format, "warning")
    inventory = _scan(config)
    if args.json:
        print(json.dumps(inventory_dict(inventory), indent=2))
    else:
        print(inventory_text(inventory))
    return 0


def cmd_claim_template(args: argparse.Namespace) -> int:
    import yaml

    from devplugin.policy.claim_templates import Shape, TemplateError, claim_template

    shape = Shape(args.gpus, args.hcas, prefer=args.prefer, nvlink=args.nvlink, mig=args.mig)
    try:
        document = claim_template(shape, args.driver, name=args.name, namespace=args.namespace)
    except TemplateError as exc:
        raise UsageError(f"claim-template: {exc}") from exc
    print(yaml.safe_dump(document, sort_keys=False), end="")
    return 0


def cmd_topo(args: argparse.Namespace) -> int:
    from devplugin import drawing
    from devplugin.config import KubernetesConfig
    from devplugin.node.report import topo_text
    from devplugin.picture import PictureError, dot, picture

    from_record = args.record is not None or args.node is not None or args.daemon is not None
    if args.format == "text" and from_record:
        raise UsageError(
            "--format text reads this node's hardware; draw a record with --format dot, svg or png"
        )
    config = resolve_config(args)
    setup_logging(config.logging.format, "warning")
    try:
        if args.daemon is not None:
            name, status = drawing.from_daemon(args.daemon)
        elif args.record is not None:
            name, status = drawing.from_file(args.record, args.node)
        elif args.node is not None:
            kube = KubernetesConfig(enabled=True, kubeconfig=args.kubeconfig or "")
            name, status = drawing.from_api(kube, args.node)
        else:
            inventory = _scan(config)
            if args.format == "text":
                print(topo_text(inventory))
                return 0
            name, status = drawing.from_inventory(config, inventory)
        source = dot(picture(name, status))
        data = source.encode() if args.format == "dot" else drawing.render(source, args.format)
    except (drawing.SourceError, PictureError) as exc:
        print(f"devplugin: {exc}", file=sys.stderr)
        return 1
    if args.output is not None:
        args.output.write_bytes(data)
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    setup_logging("text", "warning")
    if args.real_node:
        from devplugin.testing.realnode_demo import run_node_demo

        return run_node_demo(stay=args.stay)
    from devplugin.testing.demo import run_demo

    return run_demo()


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--listen: expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def cmd_extender(args: argparse.Namespace) -> int:
    from devplugin.cluster.client import make_client
    from devplugin.config import KubernetesConfig
    from devplugin.extender.app import serve
    from devplugin.runtime import SWITCH_INTERVAL, refreeze_heap, settle_heap

    setup_logging(args.log_format, "info")
    address = _listen(args.listen)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    for flag in ("stale_after_seconds", "watch_timeout_seconds", "request_timeout_seconds"):
        if getattr(args, flag) <= 0:
            raise UsageError(f"--{flag.replace('_', '-')}: must be greater than 0")
    kube = KubernetesConfig(
        enabled=True,
        kubeconfig=args.kubeconfig or "",
        request_timeout_seconds=args.request_timeout_seconds,
        watch_timeout_seconds=args.watch_timeout_seconds,
    )
    probe = make_client(kube)
    if probe is None:
        raise UsageError("no Kubernetes API access (--kubeconfig, or run in a pod)")
    probe.close()
    stop = _stop_on_signals()
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    # The scheduler waits on every call while the watch threads decode events
    # under the same interpreter lock: a short switch interval bounds that wait
    # (the default slice is 5 ms).
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        _, server, caches = serve(
            kube,
            address,
            stale_after=args.stale_after_seconds,
            tls=tls,
            names=(args.gpu_resource, args.hca_resource),
            lease_namespace=args.lease_namespace,
            dra=args.dra,
            device_taints=args.dra_device_taints == "on",
        )
    except (OSError, ValueError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    log.info("scheduler extender serving on %s:%d", *server.address)
    settled = False
    refrozen = time.monotonic()
    try:
        while not stop.wait(0.5):
            if not settled and all(cache.synced.is_set() for cache in caches):
                # After the first lists: what decoding them left behind goes.
                settle_heap()
                settled = True
            elif settled and time.monotonic() - refrozen > REFREEZE_SECONDS:
                # The node views the calls build are long-lived too: frozen,
                # the collector's full passes (30-350 ms at 5,000 nodes,
                # holding every call) do not walk them again and again.
                refreeze_heap()
                refrozen = time.monotonic()
    finally:
        server.stop()
        for cache in caches:
            cache.signal_stop()
    return 0


# How often the serving extender freezes what survived (refreeze_heap).
REFREEZE_SECONDS = 10.0


COMMANDS = {
    "run": cmd_run,
    "discover": cmd_discover,
    "topo": cmd_topo,
    "demo": cmd_demo,
    "extender": cmd_extender,
    "claim-template": cmd_claim_template,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"devplugin: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except BrokenPipeError:
        # The reader went away (`devplugin discover --json | head`): not an
        # error of ours. Point stdout at /dev/null so the exit flush is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
