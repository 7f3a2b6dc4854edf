"""The nvidia-caps device nodes a MIG device is reached through.

A process opens a MIG device through its parent's /dev/nvidiaN and two
capability nodes, /dev/nvidia-caps/nvidia-cap<M>: one for the GPU instance,
one for the compute instance. The driver says which minor numbers in
/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<gi>/access and
.../gi<gi>/ci<ci>/access (a `DeviceFileMinor: M` line). NVIDIA's container
runtime adds these nodes itself when told the MIG UUID by variable or CDI;
a container given device nodes alone needs them in the Allocate answer.
"""

from __future__ import annotations

from pathlib import Path

from devplugin.model import GpuInfo, ascii_int
from devplugin.node.discovery.sysfs import read_text


def _minor(path: Path) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "DeviceFileMinor":
            return ascii_int(value.strip())
    return None


def mig_caps(root: Path, gpu: GpuInfo) -> tuple[int, ...]:
    """(GPU instance minor, compute instance minor) of a served MIG device;
    () when either cannot be read (or the entry is a whole GPU)."""
    if gpu.slice is None:
        return ()
    device = gpu.slice.device
    instance = root / f"gpu{gpu.minor_number}" / "mig" / f"gi{device.gpu_instance}"
    found = (
        _minor(instance / "access"),
        _minor(instance / f"ci{device.compute_instance}" / "access"),
    )
    if found[0] is None or found[1] is None:
        return ()
    return found[0], found[1]
