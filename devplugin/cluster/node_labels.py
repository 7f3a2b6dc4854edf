"""Keeps the `devplugin.io/` labels on this node's own Node object in step
with the devices the daemon found, so pods can pick a GPU model with a
plain nodeSelector.

One loop owns the writes. It is poked after every judgement (a scan, a
hotplug, a health change) and compares the labels the last inventory calls
for with what it last made true; only a difference costs a request. Then
it reads the Node, builds a merge patch that touches only keys under the
prefix (`policy/labels.py`) and sends it with the Node's resourceVersion,
so a label someone else changed in between is never overwritten blind: a
conflict reads again and retries. A watch on the Node itself says when it
was deleted and created again (a new uid: its labels are gone) or when one
of our labels was changed by hand: either pokes the loop at once. Every
`resync` seconds the Node is read even without a change, the safety net
under the watch. Errors back off; nothing on an RPC path waits on this.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightkube import ApiError, Client
from lightkube.types import PatchType

from devplugin.cluster.client import Heartbeat
from devplugin.cluster.objects import RawNode, as_dict
from devplugin.cluster.watch import WatchCache, WatchTiming
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


@dataclass(frozen=True)
class NodeFacts:
    """What the labeller reads of its Node: which Node it is, and our labels on it."""

    uid: str
    ours: Mapping[str, str]
    # status.nodeInfo.kubeletVersion ("" where it does not say).
    kubelet_version: str = ""


def node_facts(data: Mapping[str, Any]) -> tuple[str, NodeFacts]:
    meta = data.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        raise ValueError("metadata.name missing")
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        raise ValueError("metadata.labels must be an object")
    ours = {k: str(v) for k, v in labels.items() if isinstance(k, str) and k.startswith(PREFIX)}
    status = data.get("status")
    info = status.get("nodeInfo") if isinstance(status, dict) else None
    version = info.get("kubeletVersion") if isinstance(info, dict) else None
    kubelet = version if isinstance(version, str) else ""
    return meta["name"], NodeFacts(str(meta.get("uid") or ""), ours, kubelet)


def node_cache(
    client: Client, node: str, timing: WatchTiming, heartbeat: Heartbeat | None = None
) -> WatchCache[NodeFacts]:
    """A watch on this node's own Node (one object: `metadata.name=<node>`)."""
    return WatchCache(
        client,
        RawNode,
        node_facts,
        name="node",
        namespaced=False,
        fields={"metadata.name": node},
        timing=timing,
        heartbeat=heartbeat,
    )


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
        # Bumped by each Node event that makes what was applied doubtful: a
        # round that saw it change meanwhile does not trust its own result.
        self._doubts = 0
        self.patches = 0

    def follow(self, nodes: WatchCache[NodeFacts]) -> None:
        """Act on the Node watch's events (on its thread)."""
        nodes.listen_keys(self._node_event)

    def _node_event(self, name: str, before: NodeFacts | None, after: NodeFacts | None) -> None:
        if name != self._node:
            return
        applied = self._applied
        if after is None:
            self._doubts += 1
            self._applied = None  # gone: the Node that comes back must be read
            return
        returned = before is None or before.uid != after.uid
        if returned or applied is None or dict(after.ours) != applied:
            if returned and before is not None:
                log.info("Node %s was created again: its labels are written again", self._node)
            self._doubts += 1
            self._applied = None
            self.poke()

    def _settle(self, wanted: dict[str, str], doubts: int) -> None:
        """Trust what this round made true, unless the Node changed meanwhile."""
        self._applied = wanted if self._doubts == doubts else None

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
        doubts = self._doubts
        for attempt in range(ATTEMPTS):
            self._last_read = self._clock()
            node = as_dict(self._client.get(RawNode, self._node))
            metadata = node.get("metadata", {})
            current = metadata.get("labels") or {}
            patch = label_patch(current, wanted)
            if not patch:
                self._settle(wanted, doubts)
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
            self._settle(wanted, doubts)
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
