"""`make bench`: end-to-end RPC latency over gRPC on unix sockets.

Each RPC is timed from the client side, through a real channel and the
daemon's real servicer, against a do-nothing servicer on the same gRPC path
(the floor). The ratio of our p50 to the floor's p50 shows what the daemon
adds on top of Python gRPC itself.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplugin.config import Config, override
from devplugin.daemon import Daemon
from devplugin.discovery.fake_nvml import FakeNvml
from devplugin.logs import setup_logging
from devplugin.sim.node import build_node, hgx_node


class FloorServicer(pb_grpc.DevicePluginServicer):
    """Answers Allocate with an empty response: the cost of the gRPC path alone."""

    def Allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        return pb.AllocateResponse(container_responses=[pb.ContainerAllocateResponse()])


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure(call: Callable[[], object], iterations: int, warmup: int = 50) -> list[float]:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(iterations):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1000.0)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args()
    setup_logging("text", "error")
    base = Path(tempfile.mkdtemp(prefix="dpbench-", dir="/tmp"))
    try:
        node = build_node(hgx_node(), base / "node")
        config = override(
            Config(),
            **{
                "paths.sysfs_root": str(node.sysfs_root),
                "paths.dev_root": str(node.dev_root),
                "paths.device_plugin_dir": str(base / "dp"),
                "nvml.fixture": str(node.fixture),
            },
        )
        daemon = Daemon(config, FakeNvml.from_file(node.fixture))
        daemon.start()
        floor = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_DevicePluginServicer_to_server(FloorServicer(), floor)
        floor.add_insecure_port(f"unix://{base}/floor.sock")
        floor.start()
        try:
            rows = []
            with (
                grpc.insecure_channel(f"unix://{base}/dp/devplugin-nvidia.com-gpu.sock") as ours,
                grpc.insecure_channel(f"unix://{base}/floor.sock") as bare,
            ):
                ours_stub = pb_grpc.DevicePluginStub(ours)
                bare_stub = pb_grpc.DevicePluginStub(bare)
                for size in (1, 2, 4, 8):
                    ids = [gpu.uuid for gpu in node.gpus[:size]]
                    request = pb.AllocateRequest(
                        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
                    )
                    floor_ms = measure(lambda r=request: bare_stub.Allocate(r), args.iterations)
                    ours_ms = measure(lambda r=request: ours_stub.Allocate(r), args.iterations)
                    rows.append((size, ours_ms, floor_ms))
            print("Allocate, nvidia.com/gpu, 8-GPU/8-HCA node, end to end over gRPC (ms)")
            print(f"{'size':>4}  {'p50':>7}  {'p99':>7}  {'floor p50':>9}  {'ratio':>5}")
            for size, ours_ms, floor_ms in rows:
                p50, floor50 = statistics.median(ours_ms), statistics.median(floor_ms)
                print(
                    f"{size:>4}  {p50:7.3f}  {percentile(ours_ms, 0.99):7.3f}  "
                    f"{floor50:9.3f}  {p50 / floor50:5.2f}"
                )
        finally:
            floor.stop(0)
            daemon.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
