"""What a restarted daemon makes of its checkpoint, applied in one step.

Devices in use before the restart stay out until their holder is confirmed
(then held, not cleaned) or released (then cleaned first); owed cleanups
stay owed; a claim holds its devices again; a hook a killed daemon left
running marks its device so it is killed before anything else runs there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

from devplugin.model import DeviceKind
from devplugin.node.lifecycle import custody
from devplugin.node.lifecycle.book import Page
from devplugin.node.lifecycle.checkpoint import LifecycleState
from devplugin.node.lifecycle.custody import Phase

log = logging.getLogger(__name__)


def restore(page: Page, saved: LifecycleState, names: Mapping[DeviceKind, str]) -> None:
    cleans = page.cleans
    if not saved.trusted and cleans:
        log.warning(
            "lifecycle state unknown: every %s device not held by a running container "
            "is cleaned before it is offered",
            " and ".join(names.get(k, k.value) for k in sorted(cleans, key=lambda k: k.value)),
        )
    now = page.now()
    for hold in saved.claims.values():
        page.keep(hold)
        for key in hold.held():
            record = page.get(key)
            page.set(key, custody.held_by(record, (*record.claims, hold.uid), now))
    for kind in DeviceKind:
        for device in saved.assigned[kind]:
            key = (kind, device)
            if page.get(key).phase is Phase.HELD:
                continue  # a claim's device is in use until its unprepare
            if kind in cleans:
                page.set(key, custody.unverified(page.get(key), now, adopted=False))
            else:
                page.set(key, custody.held_by(page.get(key), (), now))
        for device in saved.pending[kind]:
            key = (kind, device)
            # In use and owed at once (an older daemon's file): the holder
            # decides; its release owes the cleanup again.
            if kind in cleans and page.get(key).phase is Phase.FREE:
                page.release(key)
    for key, process in saved.running.items():
        record = replace(page.get(key), leftover=process)
        page.set(key, record)
        # Whatever the hook was doing, an idle device's state is unknown.
        if key[0] in cleans and record.phase is Phase.FREE:
            page.release(key)
    if any(saved.assigned.values()) or any(saved.pending.values()):
        log.info(
            "checkpoint: %d devices were in use, %d cleanups owed",
            sum(len(ids) for ids in saved.assigned.values()),
            sum(len(ids) for ids in saved.pending.values()),
        )
