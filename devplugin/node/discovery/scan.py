"""One whole-node scan: sysfs for PCI and RDMA, NVML for GPUs."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from devplugin.model import (
    CdiCatalog,
    GpuInfo,
    HcaInfo,
    Inventory,
    NvmlStatus,
    PciAddress,
    PciFunction,
)
from devplugin.node.deadline import Deadlines, Stuck
from devplugin.node.discovery.cdi import CdiReader
from devplugin.node.discovery.mig_caps import mig_caps
from devplugin.node.discovery.nvml import READ_TIMEOUT, NvmlGpuSource
from devplugin.node.discovery.sysfs import (
    DescriptorsExhausted,
    PortFiles,
    PortStates,
    gpu_control_nodes,
    hca_addresses,
    list_hcas,
    port_files,
    read_hca,
    read_pci_functions,
    read_port_files,
)
from devplugin.policy.mig import served_gpus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Roots:
    """Filesystem roots discovery reads from (production: /sys and /dev)."""

    sysfs: Path
    dev: Path


def _read_caps(root: Path, gpus: tuple[GpuInfo, ...]) -> list[tuple[int, ...]]:
    return [mig_caps(root, gpu) for gpu in gpus]


class Discoverer:
    """Produces immutable `Inventory` snapshots; callers diff consecutive ones.

    Every read that can block runs under `deadlines`, keyed per source: the
    PCI tree, the RDMA class listing, each HCA, NVML and each GPU. A read that
    does not return in time leaves its device listed with `error` set (from
    the last description that was read), so a wedged device is reported
    Unhealthy while the rest of the node is checked as usual.
    """

    def __init__(
        self,
        roots: Roots,
        gpus: NvmlGpuSource | None,
        deadlines: Deadlines | None = None,
        *,
        cdi: CdiReader | None = None,
        mig_strategy: str = "none",
        caps_root: Path | None = None,
    ) -> None:
        self._roots = roots
        # How MIG-enabled GPUs are served (policy/mig.py): under single and
        # mixed, a GPU's MIG devices stand in its place in every snapshot.
        self._mig_strategy = mig_strategy
        self._caps_root = caps_root
        # A MIG device's nvidia-caps minors never change while its UUID
        # lives: read once per UUID (a failed read is tried again).
        self._caps: dict[str, tuple[int, ...]] = {}
        self._gpus = gpus
        self._cdi = cdi
        self._deadlines = deadlines if deadlines is not None else Deadlines(READ_TIMEOUT)
        # Spec files are anyone's to write: their reads get a pool of their
        # own, so one that is slow never counts as a stuck hardware read
        # (which /healthz reports) nor holds a worker the checks need.
        self._cdi_deadlines = Deadlines(self._deadlines.timeout) if cdi is not None else None
        self._warned_unplaced: set[str] = set()
        self._pci: dict[PciAddress, PciFunction] | None = None
        # Last good description of each HCA, by PCI function.
        self._hcas: dict[PciAddress, HcaInfo] = {}
        self._last = Inventory()
        # The port files of the last scan's HCAs (worked out once per scan).
        self._port_files: tuple[Inventory | None, PortFiles] = (None, ())
        self._incomplete: list[str] = []

    @property
    def last(self) -> Inventory:
        """The last snapshot taken (an empty one before the first scan)."""
        return self._last

    @property
    def deadlines(self) -> Deadlines:
        return self._deadlines

    def port_states(self) -> PortStates | None:
        """The ports of the HCAs the last scan found, read now under a
        deadline; None when the read did not return in time (the next
        check reports the HCAs as it finds them)."""
        last = self._last
        if not last.hcas:
            return ()
        if self._port_files[0] is not last:
            # Which files to read changes only with a scan: worked out once.
            self._port_files = (last, port_files(self._roots.sysfs, last.hcas))
        try:
            return self._deadlines.call("ports", partial(read_port_files, self._port_files[1]))
        except Stuck:
            return None

    def scan(self, *, full: bool = True) -> Inventory:
        """A whole snapshot. `full=False` re-reads only what health depends on
        (RDMA ports and device nodes, NVML) and reuses the last PCI tree."""
        sysfs, dev = self._roots.sysfs, self._roots.dev
        self._incomplete = []
        if full or self._pci is None:
            try:
                self._pci = self._deadlines.call("pci", partial(read_pci_functions, sysfs))
            except (Stuck, DescriptorsExhausted) as exc:
                self._note(exc, "the PCI tree")
                if self._pci is None:
                    self._pci = {}
        pci = self._pci
        if self._gpus is not None:
            gpus, status = self._gpus.scan(pci)
            gpus = self._with_caps(served_gpus(gpus, self._mig_strategy))
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
        try:
            control = self._deadlines.call("dev", partial(gpu_control_nodes, dev))
        except Stuck:
            control = ()
        self._last = Inventory(
            gpus=gpus,
            hcas=self._scan_hcas(pci),
            gpu_control_nodes=control,
            nvml=status,
            pci=pci,
            cdi=self._read_cdi(),
        )
        return self._last

    def _with_caps(self, gpus: tuple[GpuInfo, ...]) -> tuple[GpuInfo, ...]:
        """Each MIG device with its nvidia-caps minors, where they can be read."""
        root = self._caps_root
        slices = {gpu.uuid: gpu for gpu in gpus if gpu.slice is not None}
        if root is None or not slices:
            self._caps.clear()
            return gpus
        known = {uuid: self._caps[uuid] for uuid in slices if uuid in self._caps}
        unread = [gpu for uuid, gpu in slices.items() if uuid not in known]
        if unread:
            try:
                found = self._deadlines.call("caps", partial(_read_caps, root, tuple(unread)))
            except (Stuck, DescriptorsExhausted) as exc:
                self._note(exc, "the MIG capability files")
                found = [()] * len(unread)
            known.update((gpu.uuid, caps) for gpu, caps in zip(unread, found, strict=True) if caps)
        self._caps = known
        return tuple(
            dataclasses.replace(gpu, slice=dataclasses.replace(gpu.slice, caps=known[gpu.uuid]))
            if gpu.slice is not None and gpu.uuid in known
            else gpu
            for gpu in gpus
        )

    def _read_cdi(self) -> CdiCatalog | None:
        if self._cdi is None or self._cdi_deadlines is None:
            return None
        try:
            return self._cdi_deadlines.call("cdi", self._cdi.read)
        except Stuck as exc:
            # The spec files are on the node's own disk; a stuck read keeps
            # what was last read rather than dropping every GPU at once.
            log.warning("CDI spec directories: %s; keeping what was read before", exc)
            return self._last.cdi

    def _scan_hcas(self, pci: Mapping[PciAddress, PciFunction]) -> tuple[HcaInfo, ...]:
        sysfs, dev = self._roots.sysfs, self._roots.dev
        try:
            names = self._deadlines.call("rdma", partial(list_hcas, sysfs))
            present = self._deadlines.call("rdma", partial(hca_addresses, sysfs, names))
        except DescriptorsExhausted as exc:
            # Nothing was learnt: keep every HCA as last read, not Unhealthy.
            self._note(exc, "the RDMA devices")
            return tuple(self._hcas.values())
        except Stuck as exc:
            # Without the listing nothing can be told about any HCA.
            return tuple(
                dataclasses.replace(hca, error=f"sysfs: {exc}") for hca in self._hcas.values()
            )
        hcas: list[HcaInfo] = []
        reads = [
            (
                f"hca-{address}",
                partial(read_hca, sysfs, dev, pci, names, name=name, address=address),
            )
            for name, address in present
        ]
        for (name, address), outcome in zip(present, self._deadlines.call_all(reads), strict=True):
            known = self._hcas.get(address)
            if isinstance(outcome, DescriptorsExhausted):
                self._note(outcome, name)
                if known is None:
                    continue
                hca = known
            elif isinstance(outcome, Stuck):
                if known is None:
                    continue  # never read: nothing to serve it from
                hca = dataclasses.replace(known, error=f"sysfs: {outcome}")
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                hca = self._hcas[address] = outcome
            hcas.append(hca)
        still_there = {address for _, address in present}
        for address in [a for a in self._hcas if a not in still_there]:
            del self._hcas[address]
        return tuple(hcas)

    @property
    def incomplete(self) -> list[str]:
        """What the last scan could not read for want of file descriptors."""
        return list(self._incomplete)

    def _note(self, exc: Exception, what: str) -> None:
        if isinstance(exc, DescriptorsExhausted):
            if not self._incomplete:
                log.error("out of file descriptors reading %s; keeping what was known", what)
            self._incomplete.append(what)

    def close(self) -> None:
        if self._gpus is not None:
            self._gpus.close()
        self._deadlines.close()
        if self._cdi_deadlines is not None:
            self._cdi_deadlines.close()
