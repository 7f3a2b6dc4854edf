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

from devplugin.kinds.gpu import family

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


# -- a pod's choice of GPU model (the extender's filter) ----------------------------

PRODUCT_ANNOTATION = f"{PREFIX}gpu-product"
EXCLUDE_ANNOTATION = f"{PREFIX}gpu-product-exclude"
# Entries one annotation may list, and characters one entry may have.
MAX_ENTRIES = 16
MAX_ENTRY = MAX_VALUE


@dataclass(frozen=True)
class ProductChoice:
    """What a pod's annotations ask of a node's GPU models: entries spelled
    as the labels are (sanitised), lower-cased, compared as substrings."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.include and not self.exclude


def _entries(annotations: Mapping[str, str], key: str) -> tuple[str, ...]:
    raw = annotations.get(key)
    if raw is None:
        return ()
    entries = [sanitise(part.strip()).lower() for part in raw.split(",")]
    found = tuple(entry for entry in entries if entry)
    if not found:
        raise ValueError(f"{key} names no product")
    if len(found) > MAX_ENTRIES:
        raise ValueError(f"{key} lists {len(found)} products; at most {MAX_ENTRIES}")
    return found


def product_choice(annotations: Mapping[str, str]) -> ProductChoice:
    """The pod's choice; ValueError for an annotation that names nothing or
    too much (the entry a pod wrote, not what a node has, is at fault)."""
    return ProductChoice(
        _entries(annotations, PRODUCT_ANNOTATION), _entries(annotations, EXCLUDE_ANNOTATION)
    )


def product_refusal(choice: ProductChoice, products: Sequence[str]) -> str | None:
    """Why a node whose GPUs have these products cannot meet the choice, or
    None when it can. A node passes the include list only when every GPU
    matches an entry, and the exclude list only when none matches one: a
    node's daemon cannot keep a pod to some of its GPUs, so a node with a
    mix passes only where every GPU would do. A GPU whose product the record
    does not name cannot be shown to match, so it fails both."""
    if choice.empty:
        return None
    names = [sanitise(product) for product in products]
    if not names:
        which = PRODUCT_ANNOTATION if choice.include else EXCLUDE_ANNOTATION
        return f"{which}: the node has no GPU"
    if any(not name for name in names):
        which = PRODUCT_ANNOTATION if choice.include else EXCLUDE_ANNOTATION
        return f"{which}: the node's record does not name its GPU models"
    shown = ", ".join(sorted(set(names)))[: MAX_VALUE * 2]
    if choice.include:
        missing = [n for n in names if not any(e in n.lower() for e in choice.include)]
        if missing:
            return (
                f"{PRODUCT_ANNOTATION}: the node's GPUs are {shown}, "
                f"not {' or '.join(choice.include)}"
            )
    hit = [n for n in names if any(e in n.lower() for e in choice.exclude)]
    if hit:
        return f"{EXCLUDE_ANNOTATION}: the node's GPUs are {shown}, excluded by the pod"
    return None
