"""ResourceClaimTemplates that ask for aligned GPU+HCA sets (pure).

DRA has no scoring; alignment is asked for with constraints. A pair is two
requests, `gpu-i` and `hca-i`. The GPU request is a prioritized list
(`firstAvailable`) of subrequests, one per level from the preferred one
down: `pix`, `pxb`, `phb`, `node`, `any`; each but the last is tied to
the HCA by a `matchAttribute` constraint on the attribute that level shares:

    [gpu-i/pix,  hca-i]  devplugin.io/pcieSwitch            (PIX)
    [gpu-i/pxb,  hca-i]  devplugin.io/pcieTopSwitch         (PXB)
    [gpu-i/phb,  hca-i]  resource.kubernetes.io/pcieRoot    (PHB)
    [gpu-i/node, hca-i]  devplugin.io/numaNode               (NODE)

The ladder sits on the GPU, the first request of the pair, because the
allocator tries each subrequest with every candidate device (and every
HCA after it) before it falls back to the next: so a PIX pair is found if
any free GPU and HCA form one, and only then PXB, and so on. (A ladder on
the second request would settle for the first GPU's best HCA.) Pairs are
placed one after another; a GPU set in one NVLink domain adds one
constraint over every GPU request on `devplugin.io/nvlinkDomain`.

The first request carries a gate: a selector on the free counts the driver
publishes on every device (`freeGpus`, `freeHcas`, and on an NVLink GPU
`freeInNvlinkDomain`). The scheduler's allocator has no count check of
its own: on a node one HCA short it walks every order of the pairs'
interchangeable requests, and on a node whose NVLink domains are all too
small every GPU order, before it gives up (millions of device tries for 8
pairs, against a Filter timeout of 10 s). With the gate such a node is
refused by the first request's scan. Where the counts say the claim fits,
the `any` rung cannot fail, so each pair settles on its own without the
walk going back to an earlier one. A device without the counts (a driver
from before them) passes the gate.

Limits (resource.k8s.io/v1): at most 32 requests and 32 constraints per
claim, at most 8 subrequests per request: so at most 8 pairs (32
constraints, 16 requests, plus the extra GPUs or HCAs beyond the pairs).
Where the NVLink constraint would make it 33, the `node` rung is left out
(NODE and SYS pairs are then told apart only by slice order).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

LEVELS = ("PIX", "PXB", "PHB", "NODE")
# The attribute each rung matches (qualified by the driver when unqualified).
RUNGS = {
    "PIX": "pcieSwitch",
    "PXB": "pcieTopSwitch",
    "PHB": "resource.kubernetes.io/pcieRoot",
    "NODE": "numaNode",
}
MAX_PAIRS = 8
# NVIDIA's profile names: 1g.10gb, 1c.3g.40gb, 1g.10gb+me.
_PROFILE = re.compile(r"^([0-9]+c\.)?[0-9]+g\.[0-9]+gb(\+[a-z]+)?$")
MAX_REQUESTS = 32
MAX_CONSTRAINTS = 32
# Results in one claim's allocation (resource/v1 AllocationResultsMaxSize).
MAX_RESULTS = 32


class TemplateError(ValueError):
    """A shape no claim can express; the message says which limit."""


@dataclass(frozen=True)
class Shape:
    gpus: int
    hcas: int
    prefer: str = "PIX"  # the best level asked for: PIX, PXB, PHB, or NONE (no ladder)
    nvlink: bool = False  # every GPU in one NVLink domain
    # A MIG profile ("1g.10gb"): the GPU requests ask for MIG devices of it
    # (published in their parent's place, so the ladder pairs them the same).
    mig: str = ""

    @property
    def pairs(self) -> int:
        return min(self.gpus, self.hcas)


def classes(driver: str) -> dict[str, str]:
    """DeviceClass name per device type (whole GPUs, HCAs, MIG devices)."""
    return {"gpu": f"gpu.{driver}", "hca": f"hca.{driver}", "mig": f"mig.{driver}"}


def device_classes(driver: str) -> list[dict[str, Any]]:
    """The DeviceClasses: each selects this driver's devices of one type."""
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {
                "selectors": [
                    {
                        "cel": {
                            "expression": f'device.driver == "{driver}" && '
                            f'device.attributes["{driver}"].type == "{kind}"'
                        }
                    }
                ]
            },
        }
        for kind, name in classes(driver).items()
    ]


def gate(shape: Shape, driver: str) -> str:
    """The CEL selector on the free counts for this shape (see above)."""
    here = f'device.attributes["{driver}"]'
    if shape.mig:
        # The first request's candidates are MIG devices of the profile: each
        # says how many of its profile are free (freeGpus counts whole GPUs).
        checks = [f"{here}.freeOfProfile >= {shape.gpus}", f"{here}.freeHcas >= {shape.hcas}"]
        return f"!has({here}.freeOfProfile) || ({' && '.join(checks)})"
    checks = [f"{here}.freeGpus >= {shape.gpus}", f"{here}.freeHcas >= {shape.hcas}"]
    if shape.nvlink and shape.gpus > 1:
        checks.append(
            f"has({here}.freeInNvlinkDomain) && {here}.freeInNvlinkDomain >= {shape.gpus}"
        )
    return f"!has({here}.freeGpus) || ({' && '.join(checks)})"


def _gated(request: dict[str, Any], expression: str) -> None:
    selector = {"cel": {"expression": expression}}
    for part in request.get("firstAvailable") or [request.get("exactly")]:
        if part is not None:
            part.setdefault("selectors", []).append(selector)


def _ladder(prefer: str, driver: str, *, node: bool) -> list[tuple[str, str]]:
    """(subrequest name, qualified attribute it matches) from the preferred level down."""
    if prefer == "NONE":
        return []
    levels = LEVELS[LEVELS.index(prefer) :]
    if not node:
        levels = tuple(level for level in levels if level != "NODE")
    return [
        (level.lower(), RUNGS[level] if "/" in RUNGS[level] else f"{driver}/{RUNGS[level]}")
        for level in levels
    ]


def _check(shape: Shape) -> None:
    """TemplateError for a shape no claim can express."""
    if shape.gpus < 0 or shape.hcas < 0 or shape.gpus + shape.hcas == 0:
        raise TemplateError("ask for at least one GPU or HCA")
    if shape.prefer not in (*LEVELS, "NONE"):
        raise TemplateError(f"prefer must be one of {', '.join(LEVELS)} or NONE")
    if shape.mig and shape.nvlink:
        raise TemplateError("MIG devices have no NVLink: nvlink and mig do not go together")
    if shape.mig and not _PROFILE.match(shape.mig):
        raise TemplateError(f"mig: {shape.mig[:40]!r} is not a MIG profile like 1g.10gb")
    if shape.gpus + shape.hcas > MAX_RESULTS:
        raise TemplateError(
            f"{shape.gpus + shape.hcas} devices: a claim's allocation holds at most "
            f"{MAX_RESULTS} (the scheduler refuses more)"
        )
    if shape.pairs > MAX_PAIRS:
        raise TemplateError(
            f"{shape.pairs} GPU+HCA pairs: a claim holds at most {MAX_PAIRS} "
            "(32 constraints, four per pair)"
        )


def claim_spec(shape: Shape, driver: str) -> dict[str, Any]:
    """The `spec` of a ResourceClaim for this shape."""
    _check(shape)
    gpu_class, hca_class = classes(driver)["mig" if shape.mig else "gpu"], classes(driver)["hca"]
    rungs = len(_ladder(shape.prefer, driver, node=True))
    nvlink = 1 if shape.nvlink and shape.gpus > 1 else 0
    ladder = _ladder(shape.prefer, driver, node=shape.pairs * rungs + nvlink <= MAX_CONSTRAINTS)
    requests: list[dict[str, Any]] = []
    constraints: list[dict[str, Any]] = []
    gpu_requests: list[str] = []
    for i in range(shape.pairs):
        gpu, hca = f"gpu-{i}", f"hca-{i}"
        gpu_requests.append(gpu)
        if ladder:
            subrequests = [
                {"name": name, "deviceClassName": gpu_class, "allocationMode": "ExactCount",
                 "count": 1}
                for name, _ in ladder
            ]  # fmt: skip
            subrequests.append(
                {"name": "any", "deviceClassName": gpu_class, "allocationMode": "ExactCount",
                 "count": 1}
            )  # fmt: skip
            requests.append({"name": gpu, "firstAvailable": subrequests})
            for name, attribute in ladder:
                constraints.append(
                    {"requests": [f"{gpu}/{name}", hca], "matchAttribute": attribute}
                )
        else:
            requests.append(_exactly(gpu, gpu_class, 1))
        requests.append(_exactly(hca, hca_class, 1))
    if shape.gpus > shape.pairs:
        requests.append(_exactly("gpus", gpu_class, shape.gpus - shape.pairs))
        gpu_requests.append("gpus")
    if shape.hcas > shape.pairs:
        requests.append(_exactly("hcas", hca_class, shape.hcas - shape.pairs))
    if nvlink:
        constraints.append({"requests": gpu_requests, "matchAttribute": f"{driver}/nvlinkDomain"})
    if len(requests) > MAX_REQUESTS or len(constraints) > MAX_CONSTRAINTS:
        raise TemplateError("the shape needs more requests or constraints than a claim holds")
    if shape.mig:
        profile = f'device.attributes["{driver}"].profile == "{shape.mig}"'
        for request in requests:
            if request["name"].startswith("gpu"):
                _gated(request, profile)
    _gated(requests[0], gate(shape, driver))
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {"devices": devices}


def _exactly(name: str, device_class: str, count: int) -> dict[str, Any]:
    return {
        "name": name,
        "exactly": {
            "deviceClassName": device_class,
            "allocationMode": "ExactCount",
            "count": count,
        },
    }


def template_name(shape: Shape) -> str:
    if shape.gpus == shape.hcas:
        base = f"{shape.gpus}-pair" if shape.gpus == 1 else f"{shape.gpus}-pairs"
    elif shape.hcas == 0:
        base = f"{shape.gpus}-gpu"
    elif shape.gpus == 0:
        base = f"{shape.hcas}-hca"
    else:
        base = f"{shape.gpus}-gpu-{shape.hcas}-hca"
    suffix = "" if shape.prefer == "PIX" or not shape.pairs else f"-{shape.prefer.lower()}"
    mig = f"-mig-{shape.mig}" if shape.mig else ""
    return f"{base}{mig}{suffix}{'-nvlink' if shape.nvlink and shape.gpus > 1 else ''}"


def claim_template(
    shape: Shape, driver: str, *, name: str = "", namespace: str = ""
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name or template_name(shape)}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": metadata,
        "spec": {"spec": claim_spec(shape, driver)},
    }


# What the chart installs.
CHART_SHAPES = (
    Shape(1, 1),
    Shape(2, 2),
    Shape(4, 4),
    Shape(8, 8),
    Shape(4, 4, nvlink=True),
    Shape(8, 8, nvlink=True),
    Shape(8, 0, prefer="NONE", nvlink=True),
)
