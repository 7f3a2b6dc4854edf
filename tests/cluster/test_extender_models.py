"""Pods choose GPU models through the extender, over real HTTP, against
records of an H100 node and an A100 node in the API server imitation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devplugin.policy.labels import ProductChoice, product_choice, product_refusal
from devplugin.testing.apiserver import ApiServerImitation
from tests.extender_support import GPU, HCA, Running, call, pod, put_record, running_extender
from tests.extender_support import synced as records_synced

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """One extender for the module's tests, which only read: an H100 node's
    record and an A100 node's (written fresh, never changed)."""
    base = tmp_path_factory.mktemp("models")
    api = ApiServerImitation()
    api.start()
    try:
        put_record(api, "h100-node", "hgx-h100", base)
        put_record(api, "a100-node", "dgx-a100", base)
        for running in running_extender(api, base):
            records_synced(running, {"h100-node", "a100-node"})
            yield running
    finally:
        api.stop()


NODES = ["h100-node", "a100-node", "no-record"]


def filtered(running: Running, **annotations: str) -> dict[str, object]:
    asking = pod("p", [{GPU: 2, HCA: 2}], **annotations)
    code, result = call(running, "filter", {"Pod": asking, "NodeNames": NODES})
    assert code == 200, result
    assert isinstance(result, dict)
    return result


@pytest.mark.parametrize(
    ("annotations", "passing"),
    [
        ({"devplugin.io/gpu-product": "H100"}, ["h100-node"]),
        ({"devplugin.io/gpu-product": "a100-sxm4"}, ["a100-node"]),
        ({"devplugin.io/gpu-product": "nvidia h100 80gb, A100"}, ["h100-node", "a100-node"]),
        ({"devplugin.io/gpu-product-exclude": "h100"}, ["a100-node"]),
        (
            {"devplugin.io/gpu-product": "nvidia", "devplugin.io/gpu-product-exclude": "A100"},
            ["h100-node"],
        ),
        ({"devplugin.io/gpu-product": "B200"}, []),
    ],
)
def test_a_pod_gets_only_nodes_of_the_models_it_chose(
    two_models: Running, annotations: dict[str, str], passing: list[str]
) -> None:
    result = filtered(two_models, **annotations)
    assert result["NodeNames"] == passing
    refused = result["FailedAndUnresolvableNodes"]
    assert isinstance(refused, dict)
    # Preemption cannot change a GPU model: every refusal is unresolvable,
    # and names the annotation that caused it.
    for name in set(NODES) - set(passing):
        assert name in refused, name
        assert "devplugin.io/gpu-product" in refused[name]
    assert "no live NodeDevices record" in refused["no-record"]


def test_without_a_choice_every_model_passes_and_a_record_less_node_is_not_blocked(
    two_models: Running,
) -> None:
    result = filtered(two_models)
    assert result["NodeNames"] == NODES
    assert result["FailedAndUnresolvableNodes"] == {}


def test_the_reason_says_what_the_node_has_and_what_the_pod_chose(two_models: Running) -> None:
    result = filtered(two_models, **{"devplugin.io/gpu-product": "B200"})
    refused = result["FailedAndUnresolvableNodes"]
    assert isinstance(refused, dict)
    assert refused["a100-node"] == (
        "devplugin.io/gpu-product: the node's GPUs are NVIDIA-A100-SXM4-80GB, not b200"
    )


def test_a_claim_only_pod_chooses_a_model_too(two_models: Running) -> None:
    asking = pod("p", [{}], **{"devplugin.io/gpu-product-exclude": "H100"})
    code, result = call(two_models, "claims/filter", {"Pod": asking, "NodeNames": NODES[:2]})
    assert code == 200, result
    assert result["NodeNames"] == ["a100-node"]
    assert "excluded by the pod" in result["FailedAndUnresolvableNodes"]["h100-node"]


def test_a_choice_that_names_nothing_is_a_bad_request_and_the_extender_keeps_serving(
    two_models: Running,
) -> None:
    asking = pod("p", [{GPU: 1}], **{"devplugin.io/gpu-product": " , ,"})
    code, result = call(two_models, "filter", {"Pod": asking, "NodeNames": NODES})
    assert code == 400
    assert "devplugin.io/gpu-product names no product" in str(result)
    assert filtered(two_models)["NodeNames"] == NODES


def test_preemption_never_offers_a_node_of_a_model_the_pod_ruled_out(two_models: Running) -> None:
    asking = pod("p", [{GPU: 8, HCA: 8}], **{"devplugin.io/gpu-product": "A100"})
    asking["spec"]["priority"] = 1000
    proposal = {
        "Pod": asking,
        "NodeNameToMetaVictims": {
            "h100-node": {"Pods": [{"UID": "uid-x"}], "NumPDBViolations": 0},
        },
    }
    code, result = call(two_models, "preempt", proposal)
    assert code == 200, result
    assert result["NodeNameToMetaVictims"] == {}


def test_a_mixed_node_passes_an_include_only_where_every_gpu_matches() -> None:
    choice = ProductChoice(include=("h100",))
    assert product_refusal(choice, [H100, H100]) is None
    assert product_refusal(choice, [H100, A100]) is not None
    assert product_refusal(ProductChoice(exclude=("a100",)), [H100, A100]) is not None
    assert product_refusal(ProductChoice(exclude=("a100",)), [H100]) is None
    # A record that does not name its products cannot show a match either way.
    assert product_refusal(choice, [""]) is not None
    assert product_refusal(ProductChoice(exclude=("a100",)), [""]) is not None
    assert product_refusal(ProductChoice(), [""]) is None


def test_entries_are_spelled_as_the_labels_and_bounded() -> None:
    found = product_choice({"devplugin.io/gpu-product": " NVIDIA H100 (80GB) ,a100"})
    assert found.include == ("nvidia-h100-80gb", "a100")
    with pytest.raises(ValueError, match="at most 16"):
        product_choice({"devplugin.io/gpu-product-exclude": ",".join("x" * 17)})
