"""The node's CDI spec directories, read the way a runtime resolves them.

Every `.json` and `.yaml` file of each directory is a spec; a directory
listed later wins a conflict with an earlier one; a device two specs of one
directory both declare is a conflict and neither counts (a runtime refuses
it too); a file a runtime would refuse declares nothing and is named once
in the log. Files are parsed again only when their size or modification
time changed. The check loop calls this under a deadline, never an RPC.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from devplugin.model import CdiCatalog
from devplugin.policy.cdi import Spec, SpecError, validate_spec

log = logging.getLogger(__name__)

# A spec file larger than this is not read (NVIDIA's run to tens of KiB).
MAX_SPEC_BYTES = 4 << 20
SPEC_SUFFIXES = (".json", ".yaml")


@dataclass(frozen=True)
class _Parsed:
    stamp: tuple[int, int]
    spec: Spec | None
    error: str


class CdiReader:
    """Reads the spec directories into a `CdiCatalog`; keeps parsed files."""

    def __init__(self, dirs: Sequence[str]) -> None:
        self.dirs = tuple(dirs)
        self._parsed: dict[str, _Parsed] = {}
        self._logged: dict[str, str] = {}

    def read(self) -> CdiCatalog:
        # (kind, name) -> (priority, path); names two specs of one priority share
        owner: dict[tuple[str, str], tuple[int, str]] = {}
        conflicts: set[tuple[str, str]] = set()
        refused: dict[str, str] = {}
        seen: set[str] = set()
        for priority, directory in enumerate(self.dirs):
            for path in _spec_files(directory):
                seen.add(path)
                parsed = self._parse(path)
                if parsed.spec is None:
                    refused[path] = parsed.error
                    continue
                for name in parsed.spec.devices:
                    key = (parsed.spec.kind, name)
                    found = owner.get(key)
                    if found is not None and found[0] == priority:
                        conflicts.add(key)
                    elif found is None or priority > found[0]:
                        owner[key] = (priority, path)
                        conflicts.discard(key)
        for path in [p for p in self._parsed if p not in seen]:
            del self._parsed[path]
            self._logged.pop(path, None)
        devices: dict[str, set[str]] = {}
        for kind, name in owner:
            if (kind, name) not in conflicts:
                devices.setdefault(kind, set()).add(name)
        for kind, name in sorted(conflicts):
            self._say(
                f"{kind}={name}",
                f"CDI device {kind}={name} is declared by two specs of one directory; "
                "a runtime refuses it, so it is not counted",
            )
        return CdiCatalog(
            dirs=self.dirs,
            devices={kind: frozenset(names) for kind, names in devices.items()},
            refused=refused,
        )

    def _parse(self, path: str) -> _Parsed:
        try:
            info = os.stat(path)
        except OSError as exc:
            return _Parsed((0, 0), None, f"cannot read: {exc.strerror or exc}")
        stamp = (info.st_mtime_ns, info.st_size)
        known = self._parsed.get(path)
        if known is not None and known.stamp == stamp:
            return known
        spec, error = None, ""
        try:
            spec = validate_spec(_load(path, info.st_size))
        except (SpecError, OSError, ValueError, yaml.YAMLError) as exc:
            error = str(exc)[:300]
            self._say(path, f"CDI spec {path} is not usable ({error}); it declares nothing")
        parsed = _Parsed(stamp, spec, error)
        self._parsed[path] = parsed
        return parsed

    def _say(self, key: str, message: str) -> None:
        # One line per problem, not one per scan.
        if self._logged.get(key) != message:
            self._logged[key] = message
            log.warning("%s", message)


def _spec_files(directory: str) -> list[str]:
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return []  # a directory that does not exist declares nothing
    found = []
    for entry in entries:
        path = os.path.join(directory, entry)
        if entry.endswith(SPEC_SUFFIXES) and os.path.isfile(path):
            found.append(path)
    return found


def _load(path: str, size: int) -> Any:
    if size > MAX_SPEC_BYTES:
        raise SpecError(f"larger than {MAX_SPEC_BYTES} bytes")
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".json"):
        return json.loads(text)
    return yaml.safe_load(text)
