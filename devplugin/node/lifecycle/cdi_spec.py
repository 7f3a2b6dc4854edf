"""The CDI spec devplugin writes for its HCAs (no vendor ships one).

One spec file of kind `hca_kind` in the last (highest priority) spec
directory: one device per HCA, named by its ibdev name (made valid for
CDI), whose edits add its uverbs, umad and issm device nodes and
`rdma_cm` (when it is there), with the device numbers sysfs gives and
`rw` access (no mknod: nothing in a container needs to create nodes). It
is readable by all (0644, as runtimes and tools expect of a spec). It
declares the oldest
`cdiVersion` its contents allow. The check loop calls `sync` with each
scan's HCAs before they are judged: the file is rewritten (a temporary file
renamed over it) only when what it would say changed, so an HCA is never
offered before the spec naming it exists. A daemon that starts again
rewrites it from what it finds (nothing stale, nothing twice). A stop
leaves it: a container holding an HCA may restart while no daemon runs (a
rollout, a crash loop), and its runtime resolves the name then. An HCA
leaves the file only when its hardware leaves the node.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from devplugin.model import HcaInfo
from devplugin.node.lifecycle.files import write_atomically
from devplugin.policy.cdi import Node, SpecError, device_spec, kind_problem, sanitize_device_name
from devplugin.policy.claims import plain_uid

log = logging.getLogger(__name__)

# Spec files are read by runtimes and by people (`cdi list`); they hold no secret.
SPEC_MODE = 0o644


def spec_file_name(kind: str) -> str:
    """`<vendor>-<class>.json`, the name CDI tools give a vendor's spec."""
    vendor, _, klass = kind.partition("/")
    return f"{vendor}-{klass}.json"


def hca_nodes(hca: HcaInfo) -> list[Node] | None:
    """The HCA's character device nodes with their numbers, or None when one
    of its own is missing or its number unknown (the HCA is then
    Unhealthy); rdma_cm is added when it is there and numbered."""
    nodes = []
    for char in hca.own_devices:
        if not char.present or char.number is None:
            return None
        nodes.append(Node(char.path, *char.number))
    if hca.rdma_cm.present and hca.rdma_cm.number is not None:
        nodes.append(Node(hca.rdma_cm.path, *hca.rdma_cm.number))
    return nodes


class HcaSpecWriter:
    def __init__(self, directory: Path, kind: str) -> None:
        problem = kind_problem(kind)
        if problem:
            raise ValueError(f"CDI kind {kind!r}: {problem}")
        self.kind = kind
        self.path = directory / spec_file_name(kind)
        self._written: dict[str, Any] | None = None
        self._failing: str | None = None

    def sync(self, hcas: Sequence[HcaInfo]) -> Mapping[str, str]:
        """Make the file describe these HCAs. Returns HCA id -> why it may
        not be offered (no spec entry for it could be written)."""
        devices: dict[str, list[Node]] = {}
        problems: dict[str, str] = {}
        for hca in hcas:
            nodes = hca_nodes(hca)
            if nodes is None:
                continue  # already Unhealthy for the node it lacks
            try:
                name = sanitize_device_name(hca.name)
            except SpecError as exc:
                problems[hca.device_id] = str(exc)
                continue
            if name in devices:
                problems[hca.device_id] = f"CDI device name {name} is taken by another HCA"
                continue
            devices[name] = nodes
        if not devices:
            self.remove()
            return problems
        document = device_spec(self.kind, devices)
        if document == self._written:
            return problems
        try:
            if self._on_disk() != document:
                write_atomically(self.path, json.dumps(document, indent=2).encode(), SPEC_MODE)
        except OSError as exc:
            reason = f"CDI spec {self.path} not written: {exc.strerror or exc}"
            if reason != self._failing:
                log.error("%s", reason)
                self._failing = reason
            self._written = None
            return {**problems, **{hca.device_id: reason for hca in hcas}}
        self._written = document
        self._failing = None
        log.info("CDI spec %s: %d HCAs (%s)", self.path, len(devices), ", ".join(sorted(devices)))
        return problems

    def remove(self) -> None:
        """No HCA on the node any more: no spec names one."""
        self._written = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("CDI spec %s not removed: %s", self.path, exc.strerror or exc)
            return
        log.info("CDI spec %s removed", self.path)

    def _on_disk(self) -> Any:
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None


class ClaimSpecs:
    """One transient CDI spec per prepared DRA claim, named
    `<vendor>-<class>_<claim uid>.json` as CDI names transient specs: the
    claim uid is in the file name and in every device name, so a runtime
    that cached an older claim's spec never confuses the two."""

    def __init__(self, directory: Path, kind: str) -> None:
        problem = kind_problem(kind)
        if problem:
            raise ValueError(f"CDI kind {kind!r}: {problem}")
        self.kind = kind
        self.directory = directory
        vendor, _, klass = kind.partition("/")
        self._prefix = f"{vendor}-{klass}_"

    def path(self, uid: str) -> Path:
        """The spec's file; ValueError for a uid that is not a plain name
        (a uid with `/` or `..` must never name a file elsewhere)."""
        if not plain_uid(uid):
            raise ValueError(f"claim uid {uid[:80]!r} is not a plain name")
        return self.directory / f"{self._prefix}{uid}.json"

    def write(self, uid: str, document: Mapping[str, Any]) -> None:
        """Raises OSError when the file cannot be written."""
        write_atomically(self.path(uid), json.dumps(document, indent=2).encode(), SPEC_MODE)

    def exists(self, uid: str) -> bool:
        return os.path.isfile(self.path(uid))

    def remove(self, uid: str) -> str | None:
        """Why the spec could not be removed, or None (also when it was not there)."""
        try:
            os.unlink(self.path(uid))
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"CDI spec {self.path(uid)} not removed: {exc.strerror or exc}"
        return None

    def on_disk(self) -> set[str]:
        """The claim uids that have a spec in the directory."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return set()
        found = {
            name[len(self._prefix) : -len(".json")]
            for name in names
            if name.startswith(self._prefix) and name.endswith(".json")
        }
        return {uid for uid in found if plain_uid(uid)}
