"""Keeps the `devplugin.io/` labels on this node's own Node object in step
with the devices the daemon found, so pods can pick a GPU model with a
plain nodeSelector.

One loop owns the writes. It is poked after every judgement (a scan, a
hotplug, a health change) and compares the labels the last inventory calls
for with what it last made true; only a difference costs a request. Then
it reads the Node, builds a merge patch that touches only keys under the
prefix (`policy/labels.py`) and sends it with the Node's resourceVersion,
so a label someone else changed in between is never overwritten blind: a
conflict reads again and retries. Every `resync` seconds the Node is read
even without a change, which is how a label someone removed by hand comes
back. Errors back off; nothing on an RPC path waits on this.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from lightkube import ApiError, Client
from lightkube.types import PatchType

from devplugin.cluster.objects import RawNode, as_dict
from devplugin.loops import Backoff, ThreadLoop
from devplugin.model import Inventory
from devplugin.policy.labels import PREFIX, GpuModel, label_patch, node_labels, sanitise

log = logging.getLogger(__name__)

LabelSource = Callable[[], Mapping[str, str]]
# Attempts at one patch when the Node keeps changing under it.
ATTEMPTS = 3


def inventory_labels(inventory: Inventory, mig_strategy: str | None = None) -> dict[str, str]:
    """The labels these devices call for (pure): every GPU and HCA found,
    healthy or not, as GPU Feature Discovery counts them. Under the single
    MIG strategy the GPU labels describe the MIG devices served as GPUs
    (product `<model>-MIG-<profile>`); under mixed they describe the
    physical GPUs, with a count per profile (`mig-<profile>.count`)."""
    gpus: list[GpuModel] = []
    physical: dict[str, GpuModel] = {}
    profiles: Counter[str] = Counter()
    for gpu in inventory.gpus:
        whole = GpuModel(gpu.name, gpu.memory_total_mib, gpu.compute_capability)
        if gpu.slice is None:
            gpus.append(whole)
            physical[gpu.uuid] = whole
            continue
        device = gpu.slice.device
        profiles[device.profile] += 1
        parent = GpuModel(gpu.name, gpu.slice.parent_memory_mib, gpu.compute_capability)
        physical.setdefault(gpu.slice.parent_uuid, parent)
        gpus.append(
            GpuModel(f"{gpu.name}-MIG-{device.profile}", device.memory_mib, gpu.compute_capability)
        )
    if mig_strategy == "mixed":
        labels = node_labels(list(physical.values()), len(inventory.hcas), mig_strategy)
        for profile, count in sorted(profiles.items()):
            labels[f"{PREFIX}mig-{sanitise(profile)}.count"] = str(count)
        return labels
    return node_labels(gpus, len(inventory.hcas), mig_strategy)


class NodeLabeller(ThreadLoop):
    def __init__(
        self,
        client: Client,
        node: str,
        wanted: LabelSource,
        *,
        check_interval: float = 10.0,
        resync: float = 300.0,
        backoff_max: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            "node-labels",
            backoff=Backoff(1.0, backoff_max),
            join_timeout=0.5,
            failing=f"labels of Node {node} not written",
        )
        self._client = client
        self._node = node
        self._wanted = wanted
        self._check = check_interval
        self._resync = resync
        self._clock = clock
        # The labels last made true on the Node (None: not known yet).
        self._applied: dict[str, str] | None = None
        self._last_read = float("-inf")
        self.patches = 0

    def starting(self) -> None:
        log.info("labels of Node %s: keeping the devplugin.io/ ones", self._node)

    def step(self) -> float:
        self.sync_once()
        return self._check

    def failed(self, exc: Exception) -> None:
        self._applied = None  # read the Node again before trusting it

    def sync_once(self) -> bool:
        """Patch the Node when its labels are not what the devices call for;
        True when a patch was sent."""
        wanted = dict(self._wanted())
        due = self._clock() - self._last_read >= self._resync
        if wanted == self._applied and not due:
            return False
        for attempt in range(ATTEMPTS):
            self._last_read = self._clock()
            node = as_dict(self._client.get(RawNode, self._node))
            metadata = node.get("metadata", {})
            current = metadata.get("labels") or {}
            patch = label_patch(current, wanted)
            if not patch:
                self._applied = wanted
                return False
            body: dict[str, Any] = {
                "metadata": {"labels": patch, "resourceVersion": metadata.get("resourceVersion")}
            }
            try:
                self._client.patch(RawNode, self._node, body, patch_type=PatchType.MERGE)
            except ApiError as exc:
                if exc.status.code == 409 and attempt < ATTEMPTS - 1:
                    continue  # the Node changed meanwhile: judge the new one
                raise
            self._applied = wanted
            self.patches += 1
            log.info(
                "Node %s labels: %s",
                self._node,
                ", ".join(
                    f"{k}={'(removed)' if v is None else v}" for k, v in sorted(patch.items())
                ),
            )
            return True
        return False  # not reached: the last attempt returns or raises
