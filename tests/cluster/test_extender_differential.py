"""The long-lived extender against a fresh computation over the same caches,
while records, Leases, pods (bound, ended, retried, replaced by namesakes
on other nodes) and claims change at random: once the events are in, every
verb answers alike. A kept answer that outlives what it was made of would
make them differ for good; a race between the two calls only for a moment
(the comparison is retried for a few seconds)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devplugin.node.alignment import ContainerAlignment
from devplugin.policy.claim_templates import CHART_SHAPES, claim_spec, device_classes
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.dra_scheduler import put_claim, put_slices, schedule_claim, spec_slices
from devplugin.testing.layouts import LAYOUTS
from tests.extender_support import (
    GPU,
    HCA,
    Running,
    inventory,
    lease,
    pod,
    record,
    running_extender,
    stamp,
    twin,
)

DRIVER = "devplugin.io"
NODES = {"n0": "hgx-h100", "n1": "hgx-h100", "n2": "pcie-server", "n3": "asymmetric"}
SHAPES = [(1, 1), (2, 2), (4, 4), (8, 8), (2, 0), (3, 1)]
STEPS = 40


@pytest.fixture
def running(api: ApiServerImitation, tmp_path: Path) -> Iterator[Running]:
    yield from running_extender(api, tmp_path, dra=True)


class World:
    """The random state, as the API imitation holds it."""

    def __init__(self, api: ApiServerImitation, base: Path, rng: random.Random) -> None:
        self.api, self.rng = api, rng
        self.devices = {}
        for node, layout in NODES.items():
            inv = inventory(layout, base / node)
            self.devices[node] = ([g.uuid for g in inv.gpus], [h.device_id for h in inv.hcas])
            self.inventories = getattr(self, "inventories", {}) | {node: inv}
        self.pods: dict[str, tuple[str, str, tuple[int, int]]] = {}  # name -> (uid, node, shape)
        self.serial = 0
        self.claims: list[str] = []
        # Per node, the pods its record names without a uid.
        self.by_name: dict[str, set[str]] = {}
        self.moved: list[str] = []

    def uid(self) -> str:
        self.serial += 1
        return f"uid-{self.serial}"

    def put_record(self, node: str) -> None:
        gpus, hcas = self.devices[node]
        free_g, free_h = list(gpus), list(hcas)
        self.rng.shuffle(free_g)
        self.rng.shuffle(free_h)
        here = [name for name, (_, where, _) in self.pods.items() if where == node]
        held = []
        for i in range(self.rng.randint(0, 3)):
            g, h = self.rng.randint(0, 2), self.rng.randint(0, 1)
            take_g, take_h = free_g[:g], free_h[:h]
            del free_g[:g], free_h[:h]
            if not (take_g or take_h):
                continue
            # A pod bound here (by uid or by name only), or one nobody knows.
            name = self.rng.choice([*here, f"ghost-{i}"]) if here else f"ghost-{i}"
            uid = self.pods[name][0] if name in self.pods and self.rng.random() < 0.5 else None
            held.append(
                ContainerAlignment(
                    "default", name, "c0", tuple(take_g), tuple(take_h), None, None, uid
                )
            )
        self.by_name[node] = {c.pod for c in held if c.uid is None}
        found = record(self.inventories[node], node, allocations=held)
        found["status"]["updated"] = stamp()
        found["metadata"] = {"name": node}
        self.api.put("nodedevices", found)

    def bind(self, name: str, node: str) -> None:
        shape = self.rng.choice(SHAPES)
        body = pod(name, [{GPU: shape[0], HCA: shape[1]}])
        uid = self.uid()
        body["metadata"]["uid"] = uid
        body["spec"]["nodeName"] = node
        body["spec"]["priority"] = self.rng.choice([0, 100])
        body["status"]["phase"] = "Running"
        self.api.put("pods", body)
        self.pods[name] = (uid, node, shape)

    def step(self) -> str:
        rng, api = self.rng, self.api
        node = rng.choice(list(NODES))
        action = rng.choice(
            [
                "record",
                "record",
                "no-record",
                "lease",
                "bind",
                "bind",
                "end",
                "namesake",
                "slices",
                "claim",
            ]
        )
        if action == "record":
            self.put_record(node)
        elif action == "no-record":
            api.remove("nodedevices", node)
        elif action == "lease":
            lease(api, node, age=rng.choice([0, 0, 500]))
        elif action == "bind":
            self.bind(f"p{rng.randint(0, 11)}", node)
        elif action == "end" and self.pods:
            # Half the time a namesake moved away from a record naming it.
            moved = [name for name in self.moved if name in self.pods]
            name = rng.choice(moved if moved and rng.random() < 0.5 else sorted(self.pods))
            if rng.random() < 0.5:
                api.remove("pods", name, "default")
            else:
                api.set_status("pods", name, "default", {"phase": "Succeeded"})
            del self.pods[name]
        elif action == "namesake" and self.pods:
            # Replaced by a namesake on another node: a holder known by that
            # name where it was is not the new pod.
            named = [
                p for p, (_, where, _) in self.pods.items() if p in self.by_name.get(where, ())
            ]
            name = rng.choice(sorted(named or self.pods))
            api.remove("pods", name, "default")
            others = [n for n in NODES if n != self.pods[name][1]]
            self.bind(name, rng.choice(others))
            self.moved.append(name)
        elif action == "slices":
            put_slices(api, spec_slices(LAYOUTS[NODES[node]](), DRIVER, node)[0])
        elif action == "claim":
            name = f"claim-{len(self.claims)}"
            put_claim(api, name, claim_spec(rng.choice(CHART_SHAPES[:3]), DRIVER))
            if rng.random() < 0.5:
                schedule_claim(api, name, "default", node)
            self.claims.append(name)
        return action

    def questions(self) -> list[tuple[str, dict[str, Any]]]:
        names = [*NODES, "nowhere"]
        asked: list[tuple[str, dict[str, Any]]] = []
        shapes = SHAPES[:4]
        if self.pods:
            # A bound pod asked about again (a retry), by its uid; then pods
            # of its shape (a retry's answer must stay its own).
            name = self.rng.choice(sorted(self.pods))
            uid, _, shape = self.pods[name]
            retry = pod(name, [{GPU: shape[0], HCA: shape[1]}])
            retry["metadata"]["uid"] = uid
            asked.append(("filter", {"Pod": retry, "NodeNames": names}))
            asked.append(("prioritize", {"Pod": retry, "NodeNames": names}))
            shapes = [shape, *shapes]
        for shape in shapes:
            body = pod(f"ask-{shape[0]}-{shape[1]}", [{GPU: shape[0], HCA: shape[1]}])
            asked.append(("filter", {"Pod": body, "NodeNames": names}))
            asked.append(("prioritize", {"Pod": body, "NodeNames": names}))
        required = pod(
            "req",
            [{GPU: 2, HCA: 2}],
            **{"devplugin.io/alignment": "PIX", "devplugin.io/alignment-policy": "required"},
        )
        required["spec"]["priority"] = 1000
        asked.append(("filter", {"Pod": required, "NodeNames": names}))
        urgent = pod("urgent", [{GPU: 4, HCA: 2}])
        urgent["spec"]["priority"] = 1000
        proposed = {
            node: {
                "Pods": [{"UID": uid} for uid, where, _ in self.pods.values() if where == node],
                "NumPDBViolations": 0,
            }
            for node in NODES
        }
        asked.append(("preempt", {"Pod": urgent, "NodeNameToMetaVictims": proposed}))
        for claim in self.claims[-2:]:
            body = pod("claimant", [{}])
            body["spec"]["resourceClaims"] = [{"name": "d", "resourceClaimName": claim}]
            asked.append(("claims/filter", {"Pod": body, "NodeNames": names}))
            asked.append(("claims/prioritize", {"Pod": body, "NodeNames": names}))
        return asked


def _answers(running: Running, verb: str, args: dict[str, Any]) -> tuple[Any, Any]:
    path = f"/scheduler/{verb}"
    fresh_one = twin(running)  # before the call: a preempt answer adds a plan
    kept = running[0].verbs()[path](args)
    fresh = fresh_one.verbs()[path](args)
    return _plain(kept), _plain(fresh)


def _plain(answer: Any) -> Any:
    return json.loads(answer) if isinstance(answer, bytes) else answer


# The second seed with the slow tests (CI runs both).
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_kept_answers_agree_with_a_fresh_computation_under_random_changes(
    api: ApiServerImitation, tmp_path: Path, running: Running, seed: int
) -> None:
    rng = random.Random(seed)
    for device_class in device_classes(DRIVER):
        api.put("deviceclasses", device_class)
    world = World(api, tmp_path, rng)
    for node in NODES:
        world.put_record(node)
        lease(api, node, age=0)
    compared = 0
    for _ in range(STEPS):
        action = world.step()
        # Asked as the scheduler asks: the long-lived extender alone, in order.
        for verb, args in world.questions():
            deadline = time.monotonic() + 5
            kept, fresh = _answers(running, verb, args)
            while kept != fresh and time.monotonic() < deadline:
                time.sleep(0.05)  # a race with an event between the two calls
                kept, fresh = _answers(running, verb, args)
            assert kept == fresh, (seed, action, verb, kept, fresh)
            compared += 1
    assert compared >= STEPS * 10
