"""The kinds this daemon serves, one line each, and the pairing between them.

Everything that walks "every kind" walks `KINDS`; everything that needs one
kind's behaviour looks it up with `wing`. Pairing sees roles only: the one
anchor kind and the partner kinds placed next to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, overload

from devplugin.kinds.base import Kind, PairRole
from devplugin.kinds.gpu import GPU
from devplugin.kinds.hca import HCA
from devplugin.model import DeviceKind


class Registry(Sequence[Kind[Any]]):
    """The served kinds in order, found by kind or by key. Extended only for
    the length of a `with` (a kind a test adds), so importers of KINDS all
    see the same kinds."""

    def __init__(self, kinds: Sequence[Kind[Any]]) -> None:
        self._set(tuple(kinds))

    def _set(self, kinds: tuple[Kind[Any], ...]) -> None:
        self._kinds = kinds
        self._by_kind = {w.kind: w for w in kinds}
        self._by_key = {w.key: w for w in kinds}

    @overload
    def __getitem__(self, index: int) -> Kind[Any]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Kind[Any]]: ...
    def __getitem__(self, index: int | slice) -> Kind[Any] | Sequence[Kind[Any]]:
        return self._kinds[index]

    def __len__(self) -> int:
        return len(self._kinds)

    def of(self, kind: DeviceKind) -> Kind[Any]:
        return self._by_kind[kind]

    def find(self, key: str) -> Kind[Any] | None:
        """The kind whose record and config key is `key`, if one is served."""
        return self._by_key.get(key)

    @contextlib.contextmanager
    def extended(self, *more: Kind[Any]) -> Iterator[None]:
        """These kinds served too, until the block ends."""
        before = self._kinds
        self._set(before + more)
        try:
            yield
        finally:
            self._set(before)


# One line per kind, in the order every walk over the kinds takes.
SERVED: tuple[Kind[Any], ...] = (
    GPU,
    HCA,
)
KINDS = Registry(SERVED)


def wing(kind: DeviceKind) -> Kind[Any]:
    return KINDS.of(kind)


def anchor() -> DeviceKind:
    """The kind every other kind is paired with."""
    return next(w.kind for w in KINDS if w.role is PairRole.ANCHOR)


def partner() -> DeviceKind:
    """The kind placed next to the anchor in the pairing's objective (the
    worst anchor-to-partner level): the first partner kind."""
    return next(w.kind for w in KINDS if w.role is PairRole.PARTNER)


def paired_with(kind: DeviceKind) -> DeviceKind:
    """The kind a device of `kind` is paired with: the partner for the
    anchor, the anchor for a partner."""
    return partner() if KINDS.of(kind).role is PairRole.ANCHOR else anchor()


def is_anchor(kind: DeviceKind) -> bool:
    return KINDS.of(kind).role is PairRole.ANCHOR


# The two roles' kinds, for code that reads a pod's pairing.
ANCHOR = anchor()
PARTNER = partner()
# The kind whose devices are cut (MIG), whose recut rules the pipeline keeps.
CUT = next(w.kind for w in KINDS if w.cut)
