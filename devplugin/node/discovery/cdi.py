"""The node's CDI spec directories, read the way a runtime resolves them.

Every `.json` and `.yaml` file of each directory is a spec; a directory
listed later wins a conflict with an earlier one; a device two specs of one
directory both declare is a conflict and neither counts (a runtime refuses
it too); a file a runtime would refuse declares nothing and is named once
in the log. Files are parsed again only when their size or modification
time changed. The check loop calls this under a deadline of its own, never
an RPC.

Anyone who can write a spec directory can write anything there, so every
file is read with bounded cost: at most `MAX_SPEC_BYTES` (real specs are
tens of KiB), nested at most `MAX_DEPTH` deep (checked on the raw text
before parsing, and a parser's recursion limit is a refusal too, never an
exception out of a check), YAML with the C loader where there is one, and
a file that keeps changing is parsed again only after a pause that grows
with what its parsing cost (`BACKOFF_FACTOR` times, at least
`BACKOFF_MIN`), doubling while it keeps changing: a file rewritten every
few seconds costs a small share of a core, and meanwhile counts as it was
last parsed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from devplugin.model import CdiCatalog
from devplugin.policy.cdi import Spec, SpecError, validate_spec

log = logging.getLogger(__name__)

# A spec file larger than this is not read (NVIDIA's run to tens of KiB).
MAX_SPEC_BYTES = 1 << 20
# Specs nest about six deep; nothing real comes near this.
MAX_DEPTH = 32
# A changed file is parsed again no sooner than this many times what its
# last parse cost, nor sooner than BACKOFF_MIN after it; the pause doubles
# while the file keeps changing, up to BACKOFF_MAX.
BACKOFF_FACTOR = 4.0
BACKOFF_MIN = 1.0
BACKOFF_MAX = 300.0
SPEC_SUFFIXES = (".json", ".yaml")
_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# Quoted strings (double, or YAML's single), then the brackets left outside them.
_QUOTED = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\n]|\'\')*\'')
_BRACKETS = re.compile(r"[\[\]{}]")


@dataclass(frozen=True)
class _Parsed:
    stamp: tuple[int, int]
    spec: Spec | None
    error: str
    # When the parse ended, and the pause before another.
    at: float = 0.0
    pause: float = 0.0


class CdiReader:
    """Reads the spec directories into a `CdiCatalog`; keeps parsed files."""

    def __init__(self, dirs: Sequence[str], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.dirs = tuple(dirs)
        self._clock = clock
        self._parsed: dict[str, _Parsed] = {}
        self._logged: dict[str, str] = {}
        self.parses = 0  # files parsed, for observers

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
        started = self._clock()
        if known is not None and started < known.at + known.pause:
            return known  # changed again too soon: counts as last parsed
        spec, error = None, ""
        self.parses += 1
        try:
            spec = validate_spec(_load(path, info.st_size))
        except RecursionError:
            error = f"nested too deeply (more than {MAX_DEPTH} levels)"
        except (SpecError, OSError, ValueError, yaml.YAMLError) as exc:
            error = str(exc)[:300]
        if spec is None:
            self._say(path, f"CDI spec {path} is not usable ({error}); it declares nothing")
        ended = self._clock()
        # A file seen changing since its last parse keeps doubling its pause.
        pause = max(BACKOFF_MIN, BACKOFF_FACTOR * (ended - started))
        if known is not None and known.at > 0 and started - known.at < 2 * known.pause + 1:
            pause = max(pause, min(BACKOFF_MAX, 2 * known.pause))
        parsed = _Parsed(stamp, spec, error, ended, pause)
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
    with open(path, "rb") as handle:
        # At most one byte past the cap: a file that grew since its stat is
        # refused without reading it all.
        raw = handle.read(MAX_SPEC_BYTES + 1)
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"larger than {MAX_SPEC_BYTES} bytes")
    text = raw.decode("utf-8")
    depth = bracket_depth(text)
    if depth > MAX_DEPTH:
        raise SpecError(f"nested {depth} deep (at most {MAX_DEPTH})")
    data = json.loads(text) if path.endswith(".json") else yaml.load(text, Loader=_SAFE_LOADER)
    depth = data_depth(data)
    if depth > MAX_DEPTH:
        raise SpecError(f"nested {depth} deep (at most {MAX_DEPTH})")
    return data


def bracket_depth(text: str) -> int:
    """How deep the brackets outside quoted strings nest: what makes a
    parser recurse, found without parsing."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_QUOTED.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(0, depth - 1)
    return deepest


def data_depth(data: Any) -> int:
    """How deep parsed data nests (YAML's indented blocks nest without
    brackets), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest
