"""What the scheduler's allocator will pick on one node for a pod's claims,
and how good its GPU+HCA pairs are (pure).

The extender ranks nodes for pods that ask for devices only through
ResourceClaims. It does not look for the best pairs a node could give: the
allocator takes the first choice its walk finds, so the extender walks
the same way (dra_walk.py) with the devices other claims hold, and judges
that choice. Pairs are the chart templates' `gpu-i` and `hca-i` requests;
a pair's level comes from the attributes its rungs match.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from devplugin.policy.cel import EvalError, Program, Unsupported, compile_selector, matches
from devplugin.policy.dra_walk import (
    Alternative,
    Device,
    Walk,
    WalkError,
    alternatives,
    constraints_of,
    untainted,
)
from devplugin.policy.ranking import rank_scores
from devplugin.policy.topology import Level

STANDARD = "resource.kubernetes.io"
# The attribute each level shares, best first (claim_templates.RUNGS,
# qualified: the driver's own ones by the device's driver).
LEVEL_ATTRIBUTES = (
    (Level.PIX, "pcieSwitch"),
    (Level.PXB, "pcieTopSwitch"),
    (Level.PHB, f"{STANDARD}/pcieRoot"),
    (Level.NODE, "numaNode"),
)
# A walk past this many device tries is not predicted: the chart's
# templates decide within it wherever the slices' free counts are current
# (make bench --dra), and a walk on counts not yet caught up with an
# allocation (the minute between the scheduler's choice and the node's
# prepare) would otherwise cost a call about 10 ms per such node.
TRY_BUDGET = 10_000


def pair_level(gpu: Device, hca: Device) -> Level:
    """The best level whose attribute the two share."""
    for level, name in LEVEL_ATTRIBUTES:
        gpu_key = name if "/" in name else f"{gpu.driver}/{name}"
        hca_key = name if "/" in name else f"{hca.driver}/{name}"
        value = gpu.attributes.get(gpu_key)
        if value is not None and value == hca.attributes.get(hca_key):
            return level
    return Level.SYS


@dataclass(frozen=True)
class Prediction:
    """The allocator's choice on a node: whether the claims fit, and the
    worst and summed level of its pairs (None: no pairs)."""

    fits: bool
    worst: Level | None = None
    total: int = 0

    def key(self) -> tuple[int, int]:
        """Lower is better: the worst pair, then the sum over pairs."""
        return (int(self.worst or 0), self.total)


class Unpredictable(Exception):
    """The extender cannot tell what the allocator does here (a selector
    outside the CEL subset, an allocator error, a walk past the budget)."""


@dataclass
class Selectors:
    """Compiled selectors (the extender's CEL cache); compile errors kept."""

    programs: dict[str, Program | Unsupported] = field(default_factory=dict)

    def program(self, expression: str) -> Program:
        found = self.programs.get(expression)
        if found is None:
            try:
                found = compile_selector(expression)
            except Unsupported as exc:
                found = exc
            self.programs[expression] = found
        if isinstance(found, Unsupported):
            raise Unpredictable(f"selector outside the supported CEL: {found}")
        return found


@dataclass
class NodeDevices:
    """One node's devices as the allocator visits them, with each
    selector's verdicts (isSelectable's cache, kept while the slices are)."""

    devices: list[Device]
    # expression -> id of the device (alive while `devices` holds it) -> verdict:
    # no key tuple per device and expression across a fleet.
    verdicts: dict[str, dict[int, bool]] = field(default_factory=dict)


def predict(
    node: NodeDevices,
    specs: Sequence[Mapping[str, Any]],
    classes: Mapping[str, Mapping[str, Any]],
    used: Iterable[tuple[str, str, str]],
    selectors: Selectors,
    *,
    device_taints: bool,
    budget: int = TRY_BUDGET,
) -> Prediction:
    """The allocator's walk for these claims on this node; Unpredictable
    where the extender cannot follow it."""
    try:
        requests = [
            alternatives(index, request, classes)
            for index, spec in enumerate(specs)
            for request in (spec.get("devices") or {}).get("requests") or []
        ]
    except (WalkError, KeyError, TypeError, ValueError) as exc:
        raise Unpredictable(f"claim not understood: {exc}") from exc
    programs = {e: selectors.program(e) for alts in requests for a in alts for e in a.expressions}

    def selectable(alternative: Alternative, device: Device) -> bool:
        view = None
        for expression in alternative.expressions:
            known = node.verdicts.get(expression)
            if known is None:
                known = node.verdicts[expression] = {}
            verdict = known.get(id(device))
            if verdict is None:
                view = view if view is not None else device.view
                try:
                    verdict = matches(programs[expression], view)
                except EvalError as exc:
                    raise Unpredictable(f"selector error on {device.name}: {exc}") from exc
                known[id(device)] = verdict
            if not verdict:
                return False
        return True

    def allowed(alternative: Alternative, device: Device) -> bool:
        return not device_taints or untainted(alternative, device)

    walk = Walk(
        node.devices,
        requests,
        [constraints_of(spec) for spec in specs],
        used,
        selectable=selectable,
        allowed=allowed,
        budget=budget,
    )
    try:
        chosen = walk.run()
    except WalkError as exc:
        raise Unpredictable(f"the allocator errors out: {exc}") from exc
    if walk.timed_out:
        raise Unpredictable(f"the walk ran past {budget} device tries")
    if chosen is None:
        return Prediction(False)
    levels = _pair_levels(chosen)
    if not levels:
        return Prediction(True)
    return Prediction(True, max(levels), sum(int(level) for level in levels))


def _pair_levels(chosen: Sequence[tuple[Alternative, Device]]) -> list[Level]:
    by_claim: dict[int, dict[str, Device]] = {}
    for alternative, device in chosen:
        by_claim.setdefault(alternative.claim, {})[alternative.request] = device
    return [level for claim in sorted(by_claim) for level in pair_levels(by_claim[claim])]


def pair_levels(chosen: Mapping[str, Device]) -> list[Level]:
    """The level of each `gpu-i` + `hca-i` pair of one claim's devices, by
    the request (or `request/subrequest`) that chose each, in pair order."""
    by_request = {request.split("/")[0]: device for request, device in chosen.items()}
    levels = []
    for request, gpu in sorted(by_request.items()):
        if not request.startswith("gpu-") or not request[4:].isdigit():
            continue
        hca = by_request.get(f"hca-{request[4:]}")
        if hca is not None:
            levels.append(pair_level(gpu, hca))
    return levels


def ranks(predictions: Mapping[str, Prediction | None], top: int = 10) -> dict[str, int]:
    """Scores: the nodes whose choice is best (worst pair, then the sum)
    get `top`, each worse distinct choice one less (down to 1); nodes where
    the claims do not fit, or nothing could be told, get 0."""
    return rank_scores(
        {name: p.key() if p is not None and p.fits else None for name, p in predictions.items()},
        top,
    )
