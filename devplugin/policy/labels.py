"""The labels a node's daemon puts on its own Node object: what GPUs and HCAs
it has, so pods can choose by model with a plain nodeSelector.

They follow GPU Feature Discovery's meaning and spelling (NVIDIA
k8s-device-plugin internal/lm/resource.go: the product with spaces turned
into dashes, memory in MiB, the count, the family from the CUDA compute
capability) under this project's own prefix, so both can label one node
without a fight. Only keys under the prefix are ever set or removed.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PREFIX = "devplugin.io/"
# A label value: at most 63 characters, alphanumeric at both ends.
MAX_VALUE = 63
_DROPPED = re.compile(r"[^A-Za-z0-9\-_. ]")


@dataclass(frozen=True)
class GpuModel:
    product: str  # as NVML names it, e.g. "NVIDIA H100 80GB HBM3"
    memory_mib: int
    compute: tuple[int, int] | None  # CUDA compute capability, when known


def sanitise(text: str) -> str:
    """GPU Feature Discovery's spelling: characters outside
    [A-Za-z0-9-_. ] dropped, spaces to dashes; then cut to a valid label
    value (63 characters, alphanumeric ends)."""
    value = _DROPPED.sub("", text).replace(" ", "-")[:MAX_VALUE]
    return value.strip("-_.")


def family(major: int, minor: int) -> str:
    """The architecture family of a compute capability, as GPU Feature
    Discovery names it ("undefined" past what it knows)."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper"}.get(
        major, "undefined"
    )


def node_labels(
    gpus: Sequence[GpuModel], hcas: int, mig_strategy: str | None = None
) -> dict[str, str]:
    """The labels for a node with these GPUs and this many HCAs. A node
    with several models is labelled by the most common one (GPU Feature
    Discovery assumes one model per node); the count is of all GPUs."""
    labels: dict[str, str] = {}
    if gpus:
        model = Counter(gpus).most_common(1)[0][0]
        labels[f"{PREFIX}gpu.product"] = sanitise(model.product)
        labels[f"{PREFIX}gpu.count"] = str(len(gpus))
        if model.memory_mib > 0:
            labels[f"{PREFIX}gpu.memory"] = str(model.memory_mib)
        if model.compute is not None and model.compute[0] > 0:
            labels[f"{PREFIX}gpu.family"] = family(*model.compute)
    if hcas:
        labels[f"{PREFIX}hca.count"] = str(hcas)
    if mig_strategy is not None:
        labels[f"{PREFIX}mig.strategy"] = mig_strategy
    return labels


def label_patch(current: Mapping[str, str], wanted: Mapping[str, str]) -> dict[str, str | None]:
    """A JSON merge patch of metadata.labels that makes the prefix's labels
    exactly `wanted` (None removes one) and leaves every other label alone;
    empty when nothing changes."""
    if any(not key.startswith(PREFIX) for key in wanted):
        raise ValueError(f"only labels under {PREFIX} are ours to set")
    patch: dict[str, str | None] = {
        key: value for key, value in wanted.items() if current.get(key) != value
    }
    for key in current:
        if key.startswith(PREFIX) and key not in wanted:
            patch[key] = None
    return patch
