"""Node labels (policy/labels.py): GPU Feature Discovery's meaning and
spelling under devplugin.io/, and patches that touch only that prefix."""

from __future__ import annotations

import pytest

from devplugin.policy.labels import GpuModel, family, label_patch, node_labels, sanitise

H100 = GpuModel("NVIDIA H100 80GB HBM3", 81559, (9, 0))
A100 = GpuModel("NVIDIA A100-SXM4-40GB", 40960, (8, 0))


@pytest.mark.parametrize(
    ("raw", "label"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA-A100-SXM4-40GB"),
        ("Tesla V100 (PCIe) 16GB", "Tesla-V100-PCIe-16GB"),
        ("  GeForce RTX 4090*  ", "GeForce-RTX-4090"),
        ("x" * 80, "x" * 63),
    ],
)
def test_products_are_spelled_as_gpu_feature_discovery_spells_them(raw: str, label: str) -> None:
    assert sanitise(raw) == label


@pytest.mark.parametrize(
    ("compute", "name"),
    [
        ((7, 0), "volta"),
        ((7, 5), "turing"),
        ((8, 0), "ampere"),
        ((8, 6), "ampere"),
        ((8, 9), "ada-lovelace"),
        ((9, 0), "hopper"),
        ((6, 1), "pascal"),
        ((42, 0), "undefined"),
    ],
)
def test_the_family_follows_the_compute_capability(compute: tuple[int, int], name: str) -> None:
    assert family(*compute) == name


def test_a_node_is_labelled_by_its_most_common_model_and_counts_every_device() -> None:
    labels = node_labels([H100, H100, H100, A100], hcas=8)
    assert labels == {
        "devplugin.io/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "devplugin.io/gpu.count": "4",
        "devplugin.io/gpu.memory": "81559",
        "devplugin.io/gpu.family": "hopper",
        "devplugin.io/hca.count": "8",
    }
    assert node_labels([], hcas=0) == {}
    unknown = node_labels([GpuModel("Some GPU", 0, None)], hcas=0, mig_strategy="none")
    assert unknown == {
        "devplugin.io/gpu.product": "Some-GPU",
        "devplugin.io/gpu.count": "1",
        "devplugin.io/mig.strategy": "none",
    }


def test_a_patch_sets_and_removes_only_labels_under_the_prefix() -> None:
    current = {
        "kubernetes.io/hostname": "n1",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",  # GPU Feature Discovery's
        "devplugin.io/gpu.count": "8",
        "devplugin.io/hca.count": "8",
    }
    wanted = {"devplugin.io/gpu.count": "7", "devplugin.io/gpu.product": "NVIDIA-H100"}
    assert label_patch(current, wanted) == {
        "devplugin.io/gpu.count": "7",
        "devplugin.io/gpu.product": "NVIDIA-H100",
        "devplugin.io/hca.count": None,  # its devices went away
    }
    assert label_patch(current, ours(current)) == {}  # nothing to change
    with pytest.raises(ValueError, match=r"devplugin\.io/"):
        label_patch(current, {"nvidia.com/gpu.count": "1"})


def ours(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k.startswith("devplugin.io/")}
