"""The kinds this daemon serves, one line each, and the pairing between them.

Everything that walks "every kind" walks `KINDS`; everything that needs one
kind's behaviour looks it up with `wing`. Pairing sees roles only: the one
anchor kind and the partner kinds placed next to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from devplugin.kinds.base import Kind, PairRole
from devplugin.kinds.gpu import GPU
from devplugin.kinds.hca import HCA
from devplugin.model import DeviceKind

KINDS: tuple[Kind[Any], ...] = (
    GPU,
    HCA,
)

WINGS: Mapping[DeviceKind, Kind[Any]] = {wing.kind: wing for wing in KINDS}
BY_KEY: Mapping[str, Kind[Any]] = {wing.key: wing for wing in KINDS}


def wing(kind: DeviceKind) -> Kind[Any]:
    return WINGS[kind]


def anchor() -> DeviceKind:
    """The kind every other kind is paired with."""
    return next(w.kind for w in KINDS if w.role is PairRole.ANCHOR)


def partner() -> DeviceKind:
    """The kind placed next to the anchor (one today: pairing's objective
    is the worst anchor-to-partner level)."""
    return next(w.kind for w in KINDS if w.role is PairRole.PARTNER)


def paired_with(kind: DeviceKind) -> DeviceKind:
    """The kind a device of `kind` is paired with: the partner for the
    anchor, the anchor for a partner."""
    return partner() if WINGS[kind].role is PairRole.ANCHOR else anchor()


def is_anchor(kind: DeviceKind) -> bool:
    return WINGS[kind].role is PairRole.ANCHOR


# The two roles' kinds, for code that reads a pod's pairing.
ANCHOR = anchor()
PARTNER = partner()
# The kind whose devices are cut (MIG), whose recut rules the pipeline keeps.
CUT = next(w.kind for w in KINDS if w.cut)
