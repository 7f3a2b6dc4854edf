"""When a device-plugin device counts as released, from the pod side.

The kubelet never says that a container let a device go; PodResources
answers tell it by leaving the device out. A device held by a container
(HELD, or UNVERIFIED after a restart) is released once `confirmations`
answers in a row have left it out and, with the pod watch, once its pod has
ended too: PodResources can answer empty for a while, and a finished init
container's devices stay its pod's until the pod ends. Kinds served through
DRA (`explicit`) are never released this way; their claims say when.

`settle` is a pure step over the custody records: it returns the records it
changed and the keys it releases; `Releases`, the port the PodResources
monitor and the pod watch are given, applies both in one step of the book.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Set
from dataclasses import dataclass, field, replace
from typing import Protocol

from devplugin.model import DeviceKind
from devplugin.node.ledger import Ledger
from devplugin.node.lifecycle.book import Book
from devplugin.node.lifecycle.custody import FREE, Custody, Key, Owner, Phase, held_by, order

log = logging.getLogger(__name__)


class PodWitness(Protocol):
    """What the cluster says about a pod (the pod watch); never blocks."""

    def uid_of(self, namespace: str, pod: str) -> str | None:
        """The uid of the pod of that name on this node now, if known."""

    def ended(self, owner: Owner) -> bool | None:
        """Whether the pod is gone or finished; None when the watch cannot tell."""

    def init_claimant(self, resource: str) -> bool | None:
        """Whether a live pod on this node has a (run-once) init container
        asking for `resource`; None when the watch cannot tell."""


@dataclass
class Settled:
    # Records changed without a release (counts, owners, a holder confirmed).
    changed: dict[Key, Custody] = field(default_factory=dict)
    # Devices now released, in a stable order.
    released: list[Key] = field(default_factory=list)
    # Whether anything the checkpoint or the verdicts show changed.
    visible: bool = False


@dataclass(frozen=True)
class ReleaseRule:
    confirmations: int
    names: Mapping[DeviceKind, str]
    witness: PodWitness | None = None
    explicit: Collection[DeviceKind] = ()

    def settle(
        self,
        records: Mapping[Key, Custody],
        taken: Mapping[DeviceKind, Set[str]],
        owners: Mapping[Key, Owner],
        *,
        count: bool,
    ) -> Settled:
        """One PodResources answer (`count`), or a change of the pod watch
        (not counted: only releases held back for a running pod may go)."""
        out = Settled()

        def current(key: Key) -> Custody:
            return out.changed.get(key) or records.get(key, FREE)

        for key, owner in owners.items():
            record = records.get(key)
            if record is not None and record.phase in (Phase.HELD, Phase.UNVERIFIED):
                out.changed[key] = replace(record, owner=owner, unnamed=False)
        for kind in DeviceKind:
            if kind in self.explicit:
                continue  # claims say when these are released
            effective = taken.get(kind, set())
            if count:
                for device in effective:
                    key = (kind, device)
                    record = current(key)
                    if record.phase is Phase.FREE or record.phase is Phase.UNVERIFIED:
                        # Confirmed in use: held, never cleaned while it is.
                        out.visible = True
                        record = held_by(record, (), record.since)
                        record = replace(record, owner=owners.get(key, record.owner))
                    if record.missing or record.held_back or record is not records.get(key):
                        out.changed[key] = replace(record, missing=0, held_back=False)
            candidates = sorted(
                (kind, device)
                for (k, device), record in {**records, **out.changed}.items()
                if k is kind
                and record.phase in (Phase.HELD, Phase.UNVERIFIED)
                and device not in effective
            )
            for key in sorted(candidates, key=order):
                record = current(key)
                if count:
                    record = replace(record, missing=record.missing + 1)
                    out.changed[key] = record
                if record.missing < self.confirmations:
                    continue
                ended, record = self._pod_ended(key, record)
                out.changed[key] = record
                if ended:
                    out.released.append(key)
                    out.visible = True
        return out

    def _pod_ended(self, key: Key, record: Custody) -> tuple[bool, Custody]:
        """Whether a device PodResources no longer shows may be released (and
        the record, marked when a release is held back for the first time)."""
        if self.witness is None:
            return True, record  # no pod watch: PodResources decides
        name = self.names.get(key[0], key[0].value)
        owner = record.owner
        if owner is None:
            if not record.unnamed:
                return True, record  # never seen held by a named pod: PodResources decides
            claimed = self.witness.init_claimant(name)
            if claimed is False:
                return True, record
            if not record.held_back:
                log.info(
                    "%s: %s not listed by PodResources; its pod was not known when it was "
                    "allocated and %s; not released",
                    name,
                    key[1],
                    "a running pod's init container asks for this resource"
                    if claimed
                    else "the pod watch is down",
                )
            return False, replace(record, held_back=True)
        ended = self.witness.ended(owner)
        if ended:
            return True, record
        if not record.held_back:
            log.info(
                "%s: %s not listed by PodResources, but pod %s/%s %s; not released",
                name,
                key[1],
                owner[0],
                owner[1],
                "is still running" if ended is False else "cannot be checked (pod watch down)",
            )
        return False, replace(record, held_back=True)


class Releases:
    """The pod side's port on the custody book."""

    def __init__(self, book: Book, ledger: Ledger, rule: ReleaseRule) -> None:
        self._book = book
        self._ledger = ledger
        self._rule = rule

    def observe(self) -> None:
        """The ledger has a new PodResources answer: count each in-use device
        it no longer shows as taken; enough misses in a row are a release
        (with the pod watch, once the holder's pod has also ended)."""
        self._settle(count=True)

    def reconsider(self) -> None:
        """The pod watch changed: devices held back only because their pod was
        still running may be released now."""
        if self._rule.witness is not None:
            self._settle(count=False)

    def _settle(self, *, count: bool) -> None:
        taken = {kind: self._ledger.in_use(kind) for kind in DeviceKind}
        owners = self._holders() if count else {}
        with self._book.step() as page:
            settled = self._rule.settle(page.records, taken, owners, count=count)
            # Counts and owners are not in the checkpoint: written only with
            # a change it shows.
            keep = page.set if settled.visible else page.nudge
            for key, record in settled.changed.items():
                keep(key, record)
            for key in settled.released:
                if page.release(key):
                    name = self._rule.names.get(key[0], key[0].value)
                    log.info("%s: %s released; cleanup scheduled", name, key[1])
            if settled.visible:
                page.show()
            # A failed write is tried again at every poll until one succeeds.
            page.commit(retry=True)

    def _holders(self) -> dict[Key, Owner]:
        """Who holds each device per the last PodResources answer (pods named
        with the uid the watch knows now, so a namesake later is told apart)."""
        witness = self._rule.witness
        if witness is None:
            return {}
        found: dict[Key, Owner] = {}
        uids: dict[tuple[str, str], str | None] = {}
        for (namespace, pod, _), kinds in self._ledger.holdings().containers.items():
            if (namespace, pod) not in uids:
                uids[(namespace, pod)] = witness.uid_of(namespace, pod)
            for kind, devices in kinds.items():
                for device in devices:
                    found[(kind, device)] = (namespace, pod, uids[(namespace, pod)])
        return found
