"""Which container is being admitted, from the pods bound to the node (a pure table)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from devplugin.node.admission import Outcome, admitting
from devplugin.policy.podinfo import ContainerInfo, PodInfo

GPU, HCA = "nvidia.com/gpu", "rdma/hca"


def c(name: str, gpus: int = 0, hcas: int = 0, *, sidecar: bool = False) -> ContainerInfo:
    requests = {k: v for k, v in ((GPU, gpus), (HCA, hcas)) if v}
    return ContainerInfo(name, MappingProxyType(requests), sidecar)


def p(
    name: str,
    *containers: ContainerInfo,
    init: tuple[ContainerInfo, ...] = (),
    created: str = "2026-12-03T00:00:00Z",
    phase: str = "Pending",
    deleting: bool = False,
    started: bool = False,
) -> PodInfo:
    return PodInfo(
        f"uid-{name}",
        "default",
        name,
        "node-1",
        phase,
        created,
        deleting,
        init,
        containers,
        started,
    )


def ask(pods: list[PodInfo], resource: str, size: int, held: set[tuple[str, str, str]] = set()):  # noqa: B006
    other = HCA if resource == GPU else GPU
    return admitting(pods, resource=resource, other=other, size=size, held=frozenset(held))


def test_one_pod_one_container_gives_the_exact_partner_count() -> None:
    result = ask([p("a", c("main", gpus=4, hcas=2))], GPU, 4)
    assert result.outcome is Outcome.EXACT
    assert result.partners == 2


def test_no_pod_asking_for_that_size_falls_back() -> None:
    result = ask([p("a", c("main", gpus=4, hcas=2))], GPU, 2)
    assert result.outcome is Outcome.NO_POD
    assert result.partners is None


def test_candidates_that_disagree_are_ambiguous_and_agreeing_ones_exact() -> None:
    disagree = [p("a", c("m", gpus=2, hcas=1)), p("b", c("m", gpus=2, hcas=2))]
    assert ask(disagree, GPU, 2).outcome is Outcome.AMBIGUOUS
    agree = [p("a", c("m", gpus=2, hcas=1)), p("b", c("m", gpus=2, hcas=1))]
    result = ask(agree, GPU, 2)
    assert result.outcome is Outcome.EXACT
    assert result.partners == 1


def test_init_containers_come_first_then_app_containers_in_order() -> None:
    pod = p("a", c("app1", gpus=2, hcas=2), c("app2", gpus=1, hcas=1), init=(c("prep", gpus=1),))
    # Nothing held yet: the init container is next, asking 1 GPU and no HCA.
    first = ask([pod], GPU, 1)
    assert (first.outcome, first.partners) == (Outcome.EXACT, 0)
    assert first.candidates[0].init
    # A request of 2 cannot be app1's while prep still waits for its GPU.
    assert ask([pod], GPU, 2).outcome is Outcome.NO_POD
    held = frozenset({("default", "a", "prep")})
    assert ask([pod], GPU, 2, held).partners == 2
    held |= {("default", "a", "app1")}
    result = ask([pod], GPU, 1, held)
    assert result.candidates[0].container.name == "app2"
    assert result.partners == 1


def test_finished_and_deleted_pods_are_not_candidates() -> None:
    pods = [
        p("done", c("m", gpus=2, hcas=4), phase="Succeeded"),
        p("going", c("m", gpus=2, hcas=3), deleting=True),
        p("live", c("m", gpus=2, hcas=1)),
    ]
    result = ask(pods, GPU, 2)
    assert result.outcome is Outcome.EXACT
    assert [cand.pod.name for cand in result.candidates] == ["live"]


@pytest.mark.parametrize("resource", [GPU, HCA])
def test_both_call_orders_see_the_same_container(resource: str) -> None:
    pods = [p("a", c("m", gpus=4, hcas=2), created="2026-12-03T00:00:01Z"),
            p("b", c("m", gpus=3, hcas=1), created="2026-12-03T00:00:00Z")]  # fmt: skip
    size = 4 if resource == GPU else 2
    result = ask(pods, resource, size)
    assert result.outcome is Outcome.EXACT
    assert result.candidates[0].pod.name == "a"
    assert result.partners == (2 if resource == GPU else 4)


def test_pods_are_considered_oldest_first() -> None:
    pods = [p("new", c("m", gpus=1, hcas=1), created="2026-12-03T00:00:05Z"),
            p("old", c("m", gpus=1, hcas=1), created="2026-12-03T00:00:01Z")]  # fmt: skip
    assert [x.pod.name for x in ask(pods, GPU, 1).candidates] == ["old", "new"]


def test_a_finished_init_container_counts_as_served_once_a_later_container_holds() -> None:
    # PodResources never lists a finished (non-restartable) init container,
    # but an app container holding the resource proves it was served.
    pod = p("a", c("app1", gpus=2, hcas=1), c("app2", gpus=1, hcas=1), init=(c("prep", gpus=1),))
    result = ask([pod], GPU, 1, {("default", "a", "app1")})
    assert [x.container.name for x in result.candidates] == ["app2"]
    assert result.partners == 1


def test_a_started_pod_is_past_admission() -> None:
    waiting = p("waiting", c("m", gpus=2, hcas=1), created="2026-12-03T00:00:02Z")
    running = p("running", c("m", gpus=2, hcas=2), started=True)
    result = ask([running, waiting], GPU, 2)
    assert result.outcome is Outcome.EXACT
    assert [x.pod.name for x in result.candidates] == ["waiting"]


@pytest.mark.parametrize(
    ("status", "started"),
    [
        ({"phase": "Pending"}, False),
        ({"phase": "Running"}, True),
        ({"phase": "Pending", "initContainerStatuses": [{"state": {"running": {}}}]}, True),
        ({"phase": "Pending", "containerStatuses": [{"state": {"waiting": {}}}]}, False),
        ({"phase": "Pending", "containerStatuses": "junk"}, False),
        ({"phase": "Pending", "initContainerStatuses": [{"state": {"terminated": {}}}]}, True),
    ],
)
def test_started_is_read_from_phase_and_container_states(
    status: dict[str, object], started: bool
) -> None:
    from devplugin.policy.podinfo import parse_pod

    obj = {"metadata": {"uid": "u", "namespace": "n", "name": "x"},
           "spec": {"containers": []}, "status": status}  # fmt: skip
    assert parse_pod(obj).started is started


def test_pods_already_filtered_and_ordered_give_the_same_answer() -> None:
    pods = [
        p("new", c("m", gpus=2, hcas=1), created="2026-12-03T00:00:05Z"),
        p("done", c("m", gpus=2, hcas=2), phase="Succeeded"),
        p("old", c("m", gpus=2, hcas=1), created="2026-12-03T00:00:01Z"),
    ]
    waiting = [pods[2], pods[0]]  # as the pod cache keeps them
    full = admitting(pods, resource=GPU, other=HCA, size=2, held=frozenset())
    fast = admitting(waiting, resource=GPU, other=HCA, size=2, held=frozenset(), waiting=True)
    assert full == fast
    assert [x.pod.name for x in fast.candidates] == ["old", "new"]
