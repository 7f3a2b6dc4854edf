"""The lifecycle's small state file, written atomically.

It records which devices were in use and which cleanups are owed, so a
restarted daemon neither cleans a device that is still in use nor offers
one that was released while it was down before cleaning it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from devplugin.model import DeviceKind

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass
class LifecycleState:
    assigned: dict[DeviceKind, set[str]] = field(
        default_factory=lambda: {kind: set() for kind in DeviceKind}
    )
    pending: dict[DeviceKind, set[str]] = field(
        default_factory=lambda: {kind: set() for kind in DeviceKind}
    )

    def to_json(self) -> dict[str, object]:
        return {
            "version": FORMAT_VERSION,
            "assigned": {kind.value: sorted(ids) for kind, ids in self.assigned.items()},
            "pending_cleanup": {kind.value: sorted(ids) for kind, ids in self.pending.items()},
        }

    @classmethod
    def from_json(cls, data: object) -> LifecycleState:
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ValueError("not a devplugin checkpoint of version 1")
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
        return state


class Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> LifecycleState:
        """The saved state; empty when there is none. A corrupt file is kept
        aside (for an operator to read) and reported, never trusted."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return LifecycleState()
        except OSError as exc:
            log.error("cannot read checkpoint %s: %s; starting without it", self.path, exc)
            return LifecycleState()
        try:
            return LifecycleState.from_json(json.loads(text))
        except (ValueError, json.JSONDecodeError) as exc:
            aside = self.path.with_suffix(self.path.suffix + ".corrupt")
            log.error("checkpoint %s is unreadable (%s); moved to %s", self.path, exc, aside)
            os.replace(self.path, aside)
            return LifecycleState()

    def save(self, state: LifecycleState) -> None:
        """Write a temporary file, fsync it, rename it over the old one, fsync
        the directory: a crash leaves either the old or the new file whole."""
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        data = json.dumps(state.to_json(), indent=1, sort_keys=True).encode()
        fd, temporary = tempfile.mkstemp(prefix=self.path.name + ".", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        directory_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(directory_fd)
        finally:
            os.close(directory_fd)
