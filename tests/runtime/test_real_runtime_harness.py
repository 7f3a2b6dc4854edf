"""The real-runtime tier's podman wrapper tells a crash of podman itself
from an answer, and reports the crash's reason, not its goroutine stacks."""

from __future__ import annotations

import subprocess

from tests.real_runtime import crashed

PANIC = """Error: something before
panic: runtime error: invalid memory address or nil pointer dereference
[signal SIGSEGV: segmentation violation code=0x1 addr=0x0 pc=0x55]

goroutine 1 [running]:
github.com/containers/podman/libpod.(*Container).StartAndAttach(0xc000183f80)
\tgithub.com/containers/podman/libpod/container_api.go:127 +0x18a
"""


def ended(code: int, stderr: str) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["podman"], code, "", stderr)


def test_a_go_panic_is_a_crash_reported_from_its_reason() -> None:
    report = crashed(ended(2, PANIC))
    assert report is not None
    assert report.splitlines()[0] == (
        "podman crashed: panic: runtime error: invalid memory address or nil pointer dereference"
    )
    assert "Error: something before" not in report


def test_a_runtime_fatal_error_is_a_crash() -> None:
    assert crashed(ended(2, "fatal error: concurrent map writes\n\ngoroutine 7 [running]:\n"))


def test_a_refusal_or_a_success_is_not_a_crash() -> None:
    refusal = "Error: setting up CDI devices: unresolvable CDI devices k8s.x.io/claim=a\n"
    assert crashed(ended(125, refusal)) is None
    assert crashed(ended(0, PANIC)) is None
