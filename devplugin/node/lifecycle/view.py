"""The pipeline's port on the custody book: what keeps devices out of
service, read in one snapshot, and the two things a scan may ask for; and
the census of phases the metrics read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from devplugin.model import DeviceKind
from devplugin.node.lifecycle import custody
from devplugin.node.lifecycle.book import Book
from devplugin.node.lifecycle.custody import Key, Phase
from devplugin.node.lifecycle.health import Verdict


class CustodyView:
    def __init__(self, book: Book) -> None:
        self._book = book

    def verdicts(self) -> dict[Key, Verdict]:
        """Every device kept out of service, and why (one snapshot)."""
        return self._book.verdicts()

    def census(self, kinds: frozenset[DeviceKind]) -> custody.Census:
        """Devices per phase, counted on one snapshot (for the metrics)."""
        return custody.census(self._book.records(), kinds, self._book.clock())

    def in_use(self, kind: DeviceKind) -> set[str]:
        return self._book.in_use(kind)

    def present(self, kind: DeviceKind, ids: Sequence[str]) -> None:
        """The devices a scan found. Without a trustworthy checkpoint, each one
        seen for the first time is treated as in use by an unknown holder:
        out of service until that is confirmed (held) or not (cleaned)."""
        book = self._book
        if not book.untrusted or kind not in book.cleans:
            return
        with book.step() as page:
            now = page.now()
            for device in ids:
                record = page.get((kind, device))
                if record.adopted:
                    continue
                record = replace(record, adopted=True)
                if record.phase is Phase.FREE:
                    record = custody.unverified(record, now, adopted=True)
                page.set((kind, device), record)

    def request_cleanup(self, kind: DeviceKind, device: str) -> None:
        """Clean an idle device (a GPU that recovered, or a layout that
        changed): owed a cleanup at once, out of service until it ends."""
        if kind not in self._book.cleans:
            return
        with self._book.step() as page:
            if page.get((kind, device)).phase is Phase.FREE:
                page.release((kind, device))
                page.show()
