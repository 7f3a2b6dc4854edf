"""The device plugin's port on the custody book: Allocate's takes.

Before an Allocate hands devices out it takes them (`take`): devices the
kubelet proves released by allocating them again are released in that
step; a device owed a cleanup has it asked for now and waited for, never
past the caller's deadline (a retryable Problem naming the device and the
cleanup); a device another holder has is refused. Once the container has
them, `allocated` records its holder; an Allocate that failed between the
two gives them back (`abandon`), dirty if its init hook ran.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

from devplugin.model import DeviceKind
from devplugin.node.lifecycle import custody
from devplugin.node.lifecycle.book import Book, unique
from devplugin.node.lifecycle.custody import OWING, Owner, Phase, Problem
from devplugin.node.lifecycle.hooks import HookSpec, Tracker

log = logging.getLogger(__name__)


class Takes:
    def __init__(
        self,
        book: Book,
        *,
        hooks: Mapping[DeviceKind, HookSpec],
        names: Mapping[DeviceKind, str],
        cancel: threading.Event,
        named_holders: bool,
    ) -> None:
        """`hooks`: the cleanup hook of each kind that has one; `cancel`: set
        at stop (running hooks are killed); `named_holders`: the pod watch can
        name a container's pod (else PodResources will)."""
        self._book = book
        self._hooks = dict(hooks)
        self._names = dict(names)
        self.cancel = cancel
        self._named = named_holders

    def cleans(self, kind: DeviceKind) -> bool:
        """Whether devices of this kind have a cleanup hook."""
        return kind in self._hooks

    def cleanup_timeout(self, kind: DeviceKind) -> float:
        """How long one cleanup of this kind may run (0 without a hook)."""
        spec = self._hooks.get(kind)
        return spec.timeout if spec is not None else 0.0

    def tracker(self, kind: DeviceKind, ids: Sequence[str]) -> Tracker:
        return self._book.tracker([(kind, device) for device in ids])

    def take(
        self,
        kind: DeviceKind,
        ids: Sequence[str],
        *,
        shared: bool = False,
        wait_until: float | None = None,
    ) -> Problem | None:
        """Take these devices for an Allocate, all in one step, or none.

        `shared`: the device is served as replicas; allocating one says
        nothing of the others' holders, and a held one may be joined."""
        keys = unique([(kind, device) for device in ids])
        with self._book.step() as page:
            for key in keys:
                if not custody.reuse_releases(page.get(key), shared=shared):
                    continue
                if page.release(key):
                    log.info(
                        "%s: %s allocated again before its release was seen; "
                        "cleaned before it is given",
                        self._names.get(kind, kind.value),
                        key[1],
                    )
                page.show()
            page.commit()
            problem = page.await_takeable(
                keys, lambda record: custody.for_container(record, shared=shared), wait_until
            )
            if problem is not None:
                return problem
            now = page.now()
            for key in keys:
                record = page.get(key)
                if record.phase is not Phase.FREE:
                    continue
                if kind in self._hooks:
                    page.set(key, custody.taking(record, now))
                else:
                    # Only a kind with a cleanup hook needs the take on disk
                    # before its init runs: a restart cleans what it finds taken.
                    page.nudge(key, custody.taking(record, now))
            # Unrecorded, a crash would forget they were handed out and offer
            # them uncleaned: not taken.
            error = page.commit(required=True)
        return None if error is None else Problem(error)

    def allocated(self, kind: DeviceKind, ids: Sequence[str], owner: Owner | None = None) -> None:
        """An Allocate gave these devices to a container of `owner`'s pod (when
        the pod watch could tell)."""
        if not self._named:
            owner = None
        with self._book.step() as page:
            now = page.now()
            for key in unique([(kind, device) for device in ids]):
                record = page.get(key)
                if record.phase in OWING:
                    # Unreachable through take; loud if it ever is.
                    log.error(
                        "%s: %s given while %s", self._names[kind], key[1], record.phase.value
                    )
                    continue
                # A new holder: the pod being admitted when the pod watch can
                # tell, else PodResources will say.
                unnamed = owner is None and self._named
                page.set(key, custody.given(record, owner, unnamed=unnamed, now=now))

    def abandon(self, kind: DeviceKind, ids: Sequence[str], *, dirty: bool) -> None:
        """An Allocate that took these devices failed before giving them.
        `dirty`: its init hook ran (even in part), so they are cleaned first."""
        with self._book.step() as page:
            for key in unique([(kind, device) for device in ids]):
                if page.get(key).phase is Phase.TAKING and page.release(key, dirty=dirty):
                    page.show()
