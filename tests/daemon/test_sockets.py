"""The moment a server's unix socket appears, and a watcher that meets a
socket not yet answering: the two sides of plugin registration."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import grpc
import pytest

from devplugin.api import pluginregistration_v1_pb2 as reg_pb
from devplugin.api import pluginregistration_v1_pb2_grpc as reg_grpc
from devplugin.rpc import MAX_SOCKET_PATH, SOCKET_MODE, SocketServer
from devplugin.testing.dra_kubelet import DraKubeletSimulator
from tests.waiting import wait_until


def _first_sight(
    path: Path, seen: list[tuple[int, bool]], go: threading.Event, done: threading.Event
) -> None:
    """Polls as tightly as it can; at the first sight of the file after each
    `go`, notes its mode and whether it took a connection. Until `done`."""
    while not done.is_set():
        if not go.wait(0.05):
            continue
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            continue
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(str(path))
                took = True
            except OSError:
                took = False
        go.clear()
        seen.append((mode, took))


def test_a_socket_appears_only_listening_and_with_its_final_mode(sock_dir: Path) -> None:
    path = sock_dir / "plugins" / "probe.sock"
    server = SocketServer("probe", path, lambda _server: None)
    seen: list[tuple[int, bool]] = []
    go, done = threading.Event(), threading.Event()
    watcher = threading.Thread(target=_first_sight, args=(path, seen, go, done), daemon=True)
    watcher.start()
    # The process umask would leave a socket bound in place readable by all
    # until the chmod; the first sight must already be the final file.
    old_umask = os.umask(0)
    try:
        for round_ in range(20):
            go.set()
            server.start()
            assert wait_until(lambda n=round_ + 1: len(seen) == n, timeout=5)
            if round_ % 2:
                # Wiped under a running server, as by a kubelet restart.
                path.unlink()
            server.stop()
            assert not path.exists()
    finally:
        os.umask(old_umask)
        server.stop()
        done.set()
        watcher.join(5)
    assert seen == [(SOCKET_MODE, True)] * 20
    # Nothing of the hidden names is left behind.
    assert sorted(p.name for p in path.parent.iterdir()) == []


def test_a_hidden_name_left_by_a_killed_process_is_swept(sock_dir: Path) -> None:
    path = sock_dir / "probe.sock"
    stale = sock_dir / ".probe.sock.0a1b2c"
    stale.write_text("")
    other = sock_dir / ".other.sock.0a1b2c"
    other.write_text("")
    server = SocketServer("probe", path, lambda _server: None)
    server.start()
    try:
        assert not stale.exists()
        assert other.exists(), "another server's names are not this one's to sweep"
        assert server.intact()
    finally:
        server.stop()
    assert not path.exists()


def test_a_path_without_room_for_the_hidden_name_is_refused(sock_dir: Path) -> None:
    # The server binds `.<name>.<6 hex>` first: 8 bytes more than its path.
    room = MAX_SOCKET_PATH - 8 - len(os.fsencode(sock_dir)) - 1
    SocketServer("fits", sock_dir / ("f" * room), lambda _server: None)
    with pytest.raises(ValueError, match="temporary name"):
        SocketServer("long", sock_dir / ("g" * (room + 1)), lambda _server: None)


class _FlakyRegistration(reg_grpc.RegistrationServicer):
    """Unavailable at the first GetInfo, as a plugin still starting up."""

    def __init__(self, endpoint: Path) -> None:
        self.endpoint = endpoint
        self.calls = 0

    def GetInfo(
        self, request: reg_pb.InfoRequest, context: grpc.ServicerContext
    ) -> reg_pb.PluginInfo:
        self.calls += 1
        if self.calls == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "still starting")
        return reg_pb.PluginInfo(
            type="DRAPlugin",
            name="flaky.example.com",
            endpoint=str(self.endpoint),
            supported_versions=["v1.DRAPlugin"],
        )

    def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg_pb.RegistrationStatusResponse:
        return reg_pb.RegistrationStatusResponse()


def test_the_kubelet_tries_a_failed_registration_again(sock_dir: Path) -> None:
    endpoint = sock_dir / "plugins" / "dra.sock"
    endpoint.parent.mkdir()
    endpoint.write_text("")
    servicer = _FlakyRegistration(endpoint)
    registrar = SocketServer(
        "reg",
        sock_dir / "registry" / "flaky.example.com-reg.sock",
        lambda server: reg_grpc.add_RegistrationServicer_to_server(servicer, server),
    )
    kubelet = DraKubeletSimulator(sock_dir / "registry", node="node-a")
    kubelet.start()
    registrar.start()
    try:
        assert kubelet.wait_for(lambda: kubelet.registered("flaky.example.com"), timeout=10)
        assert servicer.calls == 2
        assert kubelet.refused == []
    finally:
        kubelet.stop()
        registrar.stop()
