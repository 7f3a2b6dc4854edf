"""The lifecycle's small state file, written atomically.

It records which devices were in use and which cleanups are owed, so a
restarted daemon neither cleans a device that is still in use nor offers
one that was released while it was down before cleaning it. Devices handed
out through DRA also have their claims here (started or completed, with what
each device was answered), in the same file, so a claim and the devices it
holds are always written together.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from devplugin.model import DeviceKind
from devplugin.node.lifecycle.files import write_atomically

log = logging.getLogger(__name__)

# Version 2 adds a checksum over the rest of the file; version 1 (without)
# is still read, so an upgrade keeps what the previous daemon knew.
FORMAT_VERSION = 2
READ_VERSIONS = frozenset({1, 2})
# A checkpoint for a few hundred devices is a few kB; anything far larger is
# not ours and is not read into memory.
MAX_SIZE = 4 * 1024 * 1024


class Hold(Protocol):
    """A DRA claim as the checkpoint keeps it. Its type is the DRA front-end's
    (frontends/dra/claim_record.py); the node needs only its uid, the
    devices it holds in custody and its own JSON form."""

    @property
    def uid(self) -> str: ...

    def held(self) -> list[tuple[DeviceKind, str]]:
        """The devices in its custody (not those it only looks at)."""

    def to_json(self) -> dict[str, object]: ...


# Reads one entry of the claims list; a ValueError makes the file unusable.
ReadHold = Callable[[object], Hold]


def no_holds(entry: object) -> Hold:
    """The reader of a daemon that serves no DRA claims."""
    raise ValueError("it lists DRA claims, and this daemon reads none")


@dataclass
class LifecycleState:
    assigned: dict[DeviceKind, set[str]] = field(
        default_factory=lambda: {kind: set() for kind in DeviceKind}
    )
    pending: dict[DeviceKind, set[str]] = field(
        default_factory=lambda: {kind: set() for kind in DeviceKind}
    )
    # Hooks running when the state was written: (kind, device) -> (process
    # group, leader start time). A crash leaves them to be killed at restart.
    running: dict[tuple[DeviceKind, str], tuple[int, int | None]] = field(default_factory=dict)
    # DRA claims by uid.
    claims: dict[str, Hold] = field(default_factory=dict)
    # False when there was no readable checkpoint (first start, deleted,
    # damaged): nothing is known about which devices are clean.
    trusted: bool = True

    def to_json(self) -> dict[str, object]:
        return {
            "version": FORMAT_VERSION,
            "assigned": {kind.value: sorted(ids) for kind, ids in self.assigned.items()},
            "pending_cleanup": {kind.value: sorted(ids) for kind, ids in self.pending.items()},
            "running_hooks": [
                {"kind": kind.value, "device": device, "pgid": pgid, "start_ticks": ticks}
                for (kind, device), (pgid, ticks) in sorted(
                    self.running.items(), key=lambda item: (item[0][0].value, item[0][1])
                )
            ],
            "claims": [claim.to_json() for _, claim in sorted(self.claims.items())],
        }

    @classmethod
    def from_json(cls, data: object, read_hold: ReadHold = no_holds) -> LifecycleState:
        if not isinstance(data, dict) or data.get("version") not in READ_VERSIONS:
            raise ValueError("not a devplugin checkpoint of version 1 or 2")
        state = cls()
        for key, target in (("assigned", state.assigned), ("pending_cleanup", state.pending)):
            section = data.get(key, {})
            if not isinstance(section, dict):
                raise ValueError(f"{key} must be a mapping")
            for kind in DeviceKind:
                ids = section.get(kind.value, [])
                if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                    raise ValueError(f"{key}.{kind.value} must be a list of ids")
                target[kind] = set(ids)
        running = data.get("running_hooks", [])
        if not isinstance(running, list):
            raise ValueError("running_hooks must be a list")
        for entry in running:
            if not isinstance(entry, dict):
                raise ValueError("running_hooks entries must be mappings")
            kind_name: object = entry.get("kind")
            device: object = entry.get("device")
            pgid: object = entry.get("pgid")
            ticks: object = entry.get("start_ticks")
            kinds = {k.value: k for k in DeviceKind}
            if not isinstance(kind_name, str) or kind_name not in kinds:
                raise ValueError("running_hooks entry without a known kind")
            if not isinstance(device, str):
                raise ValueError("running_hooks entry without a device")
            if not isinstance(pgid, int) or not _is_pid(pgid):
                raise ValueError("running_hooks entry with a bad process group")
            if ticks is not None and not (isinstance(ticks, int) and _is_int(ticks)):
                raise ValueError("running_hooks entry with a bad start time")
            state.running[(kinds[kind_name], device)] = (pgid, ticks)
        claims = data.get("claims", [])
        if not isinstance(claims, list):
            raise ValueError("claims must be a list")
        for entry in claims:
            claim = read_hold(entry)
            if claim.uid in state.claims:
                raise ValueError(f"claim {claim.uid} is listed twice")
            state.claims[claim.uid] = claim
        return state


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_pid(value: int) -> bool:
    return _is_int(value) and 1 < value < 1 << 22


class Checkpoint:
    def __init__(self, path: Path, read_hold: ReadHold = no_holds) -> None:
        self.path = path
        self._read_hold = read_hold

    def load(self) -> LifecycleState:
        """The saved state. Anything but a regular file we can read and parse
        (missing, empty, truncated, NUL-filled, wrong shape, not UTF-8, too
        deeply nested, a directory, a symlink of any kind) gives an untrusted
        empty state; a damaged one is moved aside for an operator to read."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            log.info("no checkpoint at %s (first start, or it was deleted)", self.path)
            return LifecycleState(trusted=False)
        except OSError as exc:
            return self._damaged(f"cannot stat it: {exc.strerror or exc}", move=False)
        if not stat.S_ISREG(info.st_mode):
            kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file"
            return self._damaged(f"it is {kind}")
        if info.st_size > MAX_SIZE:
            return self._damaged(f"it is {info.st_size} bytes (at most {MAX_SIZE})")
        try:
            with open(self.path, "rb") as handle:
                raw = handle.read(MAX_SIZE + 1)
        except OSError as exc:
            return self._damaged(f"cannot read it: {exc.strerror or exc}", move=False)
        try:
            return LifecycleState.from_json(
                _checked(json.loads(raw.decode("utf-8"))), self._read_hold
            )
        except (ValueError, RecursionError) as exc:
            # UnicodeDecodeError and JSONDecodeError are ValueErrors.
            return self._damaged(str(exc)[:200] or type(exc).__name__)

    def _damaged(self, reason: str, *, move: bool = True) -> LifecycleState:
        aside = self._aside() if move else None
        if aside is not None:
            try:
                os.replace(self.path, aside)
            except OSError as exc:
                aside = None
                reason += f"; could not move it aside: {exc.strerror or exc}"
        log.error(
            "checkpoint %s is unusable (%s)%s",
            self.path,
            reason,
            f"; moved to {aside}" if aside is not None else "",
        )
        return LifecycleState(trusted=False)

    def _aside(self) -> Path:
        aside = self.path.with_name(self.path.name + ".corrupt")
        number = 1
        while os.path.lexists(aside):
            aside = self.path.with_name(f"{self.path.name}.corrupt-{number}")
            number += 1
        return aside

    def save(self, state: LifecycleState) -> None:
        """Write atomically: a crash leaves either the old or the new file
        whole; its checksum says whether what is read is what was written."""
        body = state.to_json()
        body["checksum"] = _checksum(body)
        data = json.dumps(body, indent=1, sort_keys=True).encode()
        write_atomically(self.path, data)


def _checksum(body: dict[str, object]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def _checked(data: object) -> object:
    """The file's content without its checksum, which must match (version
    2); a version 1 file has none."""
    if not isinstance(data, dict) or data.get("version") != 2:
        return data
    body = dict(data)
    written = body.pop("checksum", None)
    if not isinstance(written, str):
        raise ValueError("version 2 without a checksum")
    if written != _checksum(body):
        raise ValueError("its checksum does not match its content")
    return body
