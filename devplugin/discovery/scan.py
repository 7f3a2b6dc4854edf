"""One whole-node scan: sysfs for PCI and RDMA, NVML for GPUs."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from devplugin.discovery.nvml import NvmlGpuSource
from devplugin.discovery.sysfs import gpu_control_nodes, read_hcas, read_pci_functions
from devplugin.model import Inventory, NvmlStatus, PciAddress, PciFunction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Roots:
    """Filesystem roots discovery reads from (production: /sys and /dev)."""

    sysfs: Path
    dev: Path


class Discoverer:
    """Produces immutable `Inventory` snapshots; callers diff consecutive ones."""

    def __init__(self, roots: Roots, gpus: NvmlGpuSource | None) -> None:
        self._roots = roots
        self._gpus = gpus
        self._warned_unplaced: set[str] = set()
        self._pci: dict[PciAddress, PciFunction] | None = None

    def scan(self, *, full: bool = True) -> Inventory:
        """A whole snapshot. `full=False` re-reads only what health depends on
        (RDMA ports and device nodes, NVML) and reuses the last PCI tree."""
        if full or self._pci is None:
            self._pci = read_pci_functions(self._roots.sysfs)
        pci = self._pci
        if self._gpus is not None:
            gpus, status = self._gpus.scan(pci)
        else:
            gpus, status = (), NvmlStatus(error="GPU discovery disabled")
        for gpu in gpus:
            if gpu.pci is None and gpu.uuid not in self._warned_unplaced:
                self._warned_unplaced.add(gpu.uuid)
                log.warning(
                    "GPU %s at %s is not in the sysfs PCI tree; its topology is unknown",
                    gpu.uuid,
                    gpu.pci_address,
                )
        return Inventory(
            gpus=gpus,
            hcas=read_hcas(self._roots.sysfs, self._roots.dev, pci),
            gpu_control_nodes=gpu_control_nodes(self._roots.dev),
            nvml=status,
            pci=pci,
        )

    def close(self) -> None:
        if self._gpus is not None:
            self._gpus.close()
