"""An imitation of the Kubernetes API server, over real HTTP, for the tests.

It keeps objects in memory and speaks the API's wire format where a client
can tell: lists carry `metadata.resourceVersion`; `?watch=1` streams one JSON
event per line (ADDED / MODIFIED / DELETED, and ERROR with a 410 Status when
the requested resourceVersion was compacted away); writes with a stale
`metadata.resourceVersion` get 409 Conflict (a merge patch that names one
too); labels are validated as the API server does (422); a `/status` subresource writes
only `status`; `fieldSelector=spec.nodeName=X` and `metadata.name=X` filter.

Served resources: pods (namespaced), events (namespaced), nodes (cluster),
`nodedevices.devplugin.io/v1alpha1` (cluster, with status),
`leases.coordination.k8s.io/v1` (namespaced), and from `resource.k8s.io/v1`
resourceslices and deviceclasses (cluster), resourceclaims (namespaced,
with status) and resourceclaimtemplates (namespaced). A ResourceSlice is
checked on every write against the API's limits (`testing/dra_limits.py`)
and refused with 422 Invalid, and stored as the API server stores it
(quantities made canonical, each taint's `timeAdded` filled in). `labelSelector` filters by
`key` (exists) and `key=value`.

Fault injection for the clients' error paths: `delay` (seconds added to
every request), `fail_next(n, code)` (the next n requests answer `code`),
`cut_watches()` (every open watch ends), `compact()` (older versions are
Gone), `hold_watches()` / `release_watches()` (watches deliver nothing new
meanwhile, as a lagging API server or watch cache would; lists and writes go
on), and stopping the server altogether.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import copy
import json
import re
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from devplugin.testing.dra_limits import slice_defaults, slice_problems

Obj = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    api: str  # "api/v1" or "apis/<group>/<version>"
    plural: str
    kind: str
    namespaced: bool
    status: bool = False

    @property
    def api_version(self) -> str:
        return self.api.split("/", 1)[1]


KINDS = {
    ("api/v1", "pods"): Kind("api/v1", "pods", "Pod", True, status=True),
    ("api/v1", "events"): Kind("api/v1", "events", "Event", True),
    ("api/v1", "nodes"): Kind("api/v1", "nodes", "Node", False, status=True),
    ("apis/devplugin.io/v1alpha1", "nodedevices"): Kind(
        "apis/devplugin.io/v1alpha1", "nodedevices", "NodeDevices", False, status=True
    ),
    ("apis/coordination.k8s.io/v1", "leases"): Kind(
        "apis/coordination.k8s.io/v1", "leases", "Lease", True
    ),
    ("apis/resource.k8s.io/v1", "resourceslices"): Kind(
        "apis/resource.k8s.io/v1", "resourceslices", "ResourceSlice", False
    ),
    ("apis/resource.k8s.io/v1", "resourceclaims"): Kind(
        "apis/resource.k8s.io/v1", "resourceclaims", "ResourceClaim", True, status=True
    ),
    ("apis/resource.k8s.io/v1", "resourceclaimtemplates"): Kind(
        "apis/resource.k8s.io/v1", "resourceclaimtemplates", "ResourceClaimTemplate", True
    ),
    ("apis/resource.k8s.io/v1", "deviceclasses"): Kind(
        "apis/resource.k8s.io/v1", "deviceclasses", "DeviceClass", False
    ),
    ("apis/policy/v1", "poddisruptionbudgets"): Kind(
        "apis/policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", True, status=True
    ),
}


@dataclass
class _Event:
    version: int
    type: str
    kind: Kind
    obj: Obj


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


def status_body(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    }  # fmt: skip


def _event_version(event: _Event) -> int:
    return event.version


class ApiServerImitation:
    """Thread-safe; `start()` binds 127.0.0.1 on a free port (see `url`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._objects: dict[tuple[Kind, str, str], Obj] = {}
        self._sorted_keys: dict[Kind, tuple[int, list[tuple[str, str]]]] = {}
        self._events: list[_Event] = []
        self._version = 100
        self._compacted = 0
        self._cut = 0
        # Watches deliver no event newer than this (None: all).
        self._held_at: int | None = None
        self._failures: list[int] = []
        self.delay = 0.0
        self.requests: list[tuple[str, str]] = []
        # (resource plural, verb) -> [requests, bytes received, bytes sent];
        # verbs: list, watch, get, create, update, patch, delete.
        self.traffic: dict[tuple[str, str], list[int]] = {}
        self._server: ThreadingHTTPServer | None = None
        self._address: tuple[str, int] | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------
    @property
    def url(self) -> str:
        """Where it serves (or served last: a stopped server keeps its address,
        and `start(port)` brings it back there)."""
        assert self._address is not None
        host, port = self._address
        return f"http://{host}:{port}"

    def start(self, port: int = 0) -> None:
        server = _Server(("127.0.0.1", port), self._handler())
        server.daemon_threads = True
        self._server = server
        self._address = (str(server.server_address[0]), int(server.server_address[1]))
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.cut_watches()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def kubeconfig(self, url: str | None = None) -> Obj:
        """A kubeconfig (as data) pointing at this server (or at `url`, a way
        to it such as a proxy)."""
        return {
            "apiVersion": "v1", "kind": "Config", "current-context": "imitation",
            "clusters": [{"name": "imitation", "cluster": {"server": url or self.url}}],
            "users": [{"name": "devplugin", "user": {"token": "imitation"}}],
            "contexts": [{"name": "imitation",
                          "context": {"cluster": "imitation", "user": "devplugin"}}],
        }  # fmt: skip

    # -- fault injection ---------------------------------------------------------
    def fail_next(self, count: int, code: int = 500) -> None:
        with self._cond:
            self._failures.extend([code] * count)

    def clear_failures(self) -> None:
        with self._cond:
            self._failures.clear()

    def cut_watches(self) -> None:
        with self._cond:
            self._cut += 1
            self._cond.notify_all()

    def hold_watches(self) -> None:
        """Watches deliver nothing newer than now until `release_watches`."""
        with self._cond:
            self._held_at = self._version

    def release_watches(self) -> None:
        with self._cond:
            self._held_at = None
            self._cond.notify_all()

    def _visible(self, version: int) -> bool:
        return self._held_at is None or version <= self._held_at

    def _first_visible_after(self, since: int) -> int | None:
        """The index of the first event newer than `since` that watches may
        see (events are kept in version order: a bisection, not a scan, so a
        bench with a hundred thousand objects stays quick)."""
        index = bisect.bisect_right(self._events, since, key=_event_version)
        if index < len(self._events) and self._visible(self._events[index].version):
            return index
        return None

    def compact(self) -> int:
        """Forget every event so far: a watch from an older version is Gone."""
        with self._cond:
            self._compacted = self._version
            self._events.clear()
            self._cond.notify_all()
            return self._compacted

    # -- direct access (the test's side, no HTTP) --------------------------------------
    def put(self, plural: str, obj: Obj) -> Obj:
        """Create or replace an object as a controller would (bumps its version)."""
        kind = self._kind_by_plural(plural)
        meta = obj.setdefault("metadata", {})
        with self._cond:
            key = (kind, meta.get("namespace", "") if kind.namespaced else "", meta["name"])
            existing = self._objects.get(key)
            kind_event = "MODIFIED" if existing is not None else "ADDED"
            if existing is not None:
                for field in ("uid", "creationTimestamp"):
                    meta.setdefault(field, existing["metadata"].get(field))
            else:
                meta.setdefault("uid", f"uid-{self._version + 1}")
                meta.setdefault("creationTimestamp", _now())
            return self._store_locked(kind, key, obj, kind_event)

    def get(self, plural: str, name: str, namespace: str = "") -> Obj | None:
        kind = self._kind_by_plural(plural)
        with self._cond:
            found = self._objects.get((kind, namespace if kind.namespaced else "", name))
            return copy.deepcopy(found) if found is not None else None

    def remove(self, plural: str, name: str, namespace: str = "") -> None:
        kind = self._kind_by_plural(plural)
        with self._cond:
            key = (kind, namespace if kind.namespaced else "", name)
            obj = self._objects.pop(key, None)
            if obj is not None:
                self._version += 1
                obj["metadata"]["resourceVersion"] = str(self._version)
                self._events.append(_Event(self._version, "DELETED", kind, copy.deepcopy(obj)))
                self._cond.notify_all()

    def set_status(self, plural: str, name: str, namespace: str, status: Obj) -> None:
        """Replace an object's status as its controller would (no-op if absent)."""
        kind = self._kind_by_plural(plural)
        with self._cond:
            key = (kind, namespace if kind.namespaced else "", name)
            existing = self._objects.get(key)
            if existing is not None:
                updated = copy.deepcopy(existing)
                updated["status"] = copy.deepcopy(status)
                self._store_locked(kind, key, updated, "MODIFIED")

    def items(self, plural: str) -> list[Obj]:
        kind = self._kind_by_plural(plural)
        with self._cond:
            return [copy.deepcopy(o) for (k, _, _), o in self._objects.items() if k is kind]

    def inject_raw_event(self, plural: str, event_type: str, obj: Obj) -> None:
        """A watch event carrying whatever `obj` is (bad objects, for the clients)."""
        kind = self._kind_by_plural(plural)
        with self._cond:
            self._version += 1
            self._events.append(_Event(self._version, event_type, kind, obj))
            self._cond.notify_all()

    def _kind_by_plural(self, plural: str) -> Kind:
        for kind in KINDS.values():
            if kind.plural == plural:
                return kind
        raise KeyError(plural)

    def _store_locked(self, kind: Kind, key: tuple[Kind, str, str], obj: Obj, event: str) -> Obj:
        self._version += 1
        stored = copy.deepcopy(obj)
        stored["apiVersion"] = kind.api_version
        stored["kind"] = kind.kind
        stored["metadata"]["resourceVersion"] = str(self._version)
        self._objects[key] = stored
        self._events.append(_Event(self._version, event, kind, copy.deepcopy(stored)))
        self._cond.notify_all()
        return copy.deepcopy(stored)

    # -- HTTP ----------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        imitation = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                imitation._serve(self, "GET")

            def do_POST(self) -> None:
                imitation._serve(self, "POST")

            def do_PUT(self) -> None:
                imitation._serve(self, "PUT")

            def do_PATCH(self) -> None:
                imitation._serve(self, "PATCH")

            def do_DELETE(self) -> None:
                imitation._serve(self, "DELETE")

            def log_message(self, format: str, *args: object) -> None:
                return

        return Handler

    def _serve(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        # A client that gave up (its timeout, or a stop) needs no answer.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._serve_one(handler, method)

    def _serve_one(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(handler.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        with self._cond:
            self.requests.append((method, handler.path))
            failure = self._failures.pop(0) if self._failures else None
            # A watch ends at any cut after its request was seen (and logged).
            cut = self._cut
        if self.delay:
            time.sleep(self.delay)
        if failure is not None:
            _send(handler, failure, status_body(failure, "InternalError", "injected failure"))
            return
        try:
            route = self._route(parts.path)
            watch = method == "GET" and query.get("watch") in ("1", "true")
            verb = _verb(method, route[2] is None, watch)
            self._count(route[0].plural, verb, received=len(body))
            if watch:
                self._watch(handler, route, query, cut)
                return
            code, answer = self._answer(method, route, query, body, handler.headers)
        except ApiError as exc:
            _send(handler, exc.code, status_body(exc.code, exc.reason, str(exc)))
            return
        self._count(route[0].plural, verb, sent=_send(handler, code, answer), request=False)

    def _count(
        self, plural: str, verb: str, *, received: int = 0, sent: int = 0, request: bool = True
    ) -> None:
        with self._cond:
            entry = self.traffic.setdefault((plural, verb), [0, 0, 0])
            entry[0] += request
            entry[1] += received
            entry[2] += sent

    def _route(self, path: str) -> tuple[Kind, str, str | None, bool]:
        """(kind, namespace, name, status subresource) for a path."""
        segments = [s for s in path.split("/") if s]
        prefix = "/".join(segments[:2]) if segments[:1] == ["api"] else "/".join(segments[:3])
        rest = segments[2:] if segments[:1] == ["api"] else segments[3:]
        namespace = ""
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        if not rest or (prefix, rest[0]) not in KINDS:
            raise ApiError(404, "NotFound", f"the server could not find {path}")
        kind = KINDS[(prefix, rest[0])]
        name = rest[1] if len(rest) > 1 else None
        status = len(rest) > 2 and rest[2] == "status"
        if len(rest) > 2 and not (status and kind.status):
            raise ApiError(404, "NotFound", f"the server could not find {path}")
        return kind, namespace, name, status

    def _matches(self, obj: Obj, kind: Kind, namespace: str, query: dict[str, str]) -> bool:
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        assert isinstance(meta, dict)
        if kind.namespaced and namespace and meta.get("namespace") != namespace:
            return False
        for term in filter(None, query.get("fieldSelector", "").split(",")):
            field, _, value = term.partition("=")
            value = value.lstrip("=")
            node: Any = obj
            for part in field.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if (node or "") != value:
                return False
        found = meta.get("labels")
        labels: dict[str, Any] = found if isinstance(found, dict) else {}
        for term in filter(None, query.get("labelSelector", "").split(",")):
            key, equals, value = term.partition("=")
            if not equals:  # `key`: the label exists
                if key not in labels:
                    return False
            elif labels.get(key) != value.lstrip("="):
                return False
        return True

    def _create_locked(self, kind: Kind, namespace: str, obj: Obj) -> Obj:
        meta = obj["metadata"]
        if kind.namespaced:
            meta.setdefault("namespace", namespace)
        if "generateName" in meta and "name" not in meta:
            meta["name"] = f"{meta['generateName']}{self._version + 1:x}"
        key = (kind, namespace, str(meta.get("name", "")))
        if not key[2]:
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        if key in self._objects:
            raise ApiError(409, "AlreadyExists", f'{kind.plural} "{key[2]}" already exists')
        meta["uid"] = f"uid-{self._version + 1}"
        meta["creationTimestamp"] = _now()
        meta.pop("resourceVersion", None)
        if kind.status:
            obj.pop("status", None)  # set through the subresource only
        return self._store_locked(kind, key, obj, "ADDED")

    def _list(self, kind: Kind, namespace: str, query: dict[str, str]) -> Obj:
        """A list, in pages when asked (`limit`, then `continue`): items in
        key order, each page after the last key of the one before. Every page
        says the resourceVersion of the first; unlike etcd, a later page shows
        the objects as they are now, not as they were then (a watch from that
        version replays the changes, so a cache ends up the same)."""
        token = query.get("continue")
        version, after = str(self._version), None
        if token:
            try:
                version, place = json.loads(base64.urlsafe_b64decode(token.encode()))
                after = (str(place[0]), str(place[1]))
            except (ValueError, TypeError, IndexError) as exc:
                raise ApiError(400, "BadRequest", "continue: not a token of this server") from exc
        places = self._sorted(kind)
        start = bisect.bisect_right(places, after) if after is not None else 0
        items: list[Obj] = []
        limit = int(query.get("limit") or 0)
        more = ""
        last: tuple[str, str] = ("", "")
        for place in places[start:]:
            key = (kind, *place)
            obj = self._objects[key]
            if not self._matches(obj, kind, namespace, query):
                continue
            if limit and len(items) == limit:
                more = base64.urlsafe_b64encode(json.dumps([version, list(last)]).encode()).decode()
                break
            items.append(copy.deepcopy(obj))
            last = place
        metadata: dict[str, Any] = {"resourceVersion": version}
        if more:
            metadata["continue"] = more
        return {
            "kind": f"{kind.kind}List", "apiVersion": kind.api_version,
            "metadata": metadata, "items": items,
        }  # fmt: skip

    def _sorted(self, kind: Kind) -> list[tuple[str, str]]:
        """(namespace, name) of every object of a kind, in order; sorted once
        per version of the store (a paged list of 100,000 pods sorted them
        again for each of its 200 pages)."""
        found = self._sorted_keys.get(kind)
        if found is None or found[0] != self._version:
            places = sorted((key[1], key[2]) for key in self._objects if key[0] is kind)
            found = self._sorted_keys[kind] = (self._version, places)
        return found[1]

    def _answer(
        self,
        method: str,
        route: tuple[Kind, str, str | None, bool],
        query: dict[str, str],
        body: bytes,
        headers: Any,
    ) -> tuple[int, Obj]:
        kind, namespace, name, status = route
        with self._cond:
            if method == "GET" and name is None:
                return 200, self._list(kind, namespace, query)
            key = (kind, namespace, name or "")
            if method == "GET":
                return 200, copy.deepcopy(self._existing(key))
            if method == "DELETE":
                existing = self._existing(key)
                self._objects.pop(key)
                self._version += 1
                existing["metadata"]["resourceVersion"] = str(self._version)
                self._events.append(_Event(self._version, "DELETED", kind, existing))
                self._cond.notify_all()
                return 200, status_body(200, "", "deleted") | {"status": "Success"}
            obj = self._decode(body)
            if method == "PATCH":
                if "merge-patch" not in headers.get("Content-Type", ""):
                    raise ApiError(415, "UnsupportedMediaType", "only merge patches")
                existing = self._existing(key)
                # A resourceVersion in the patch is a precondition
                # (apiserver endpoints/handlers/patch.go applies the patch,
                # then updates with the version the patched object names).
                wanted = (obj.get("metadata") or {}).get("resourceVersion")
                if wanted and wanted != existing["metadata"]["resourceVersion"]:
                    raise _conflict(kind, name)
                merged = _merge_patch(copy.deepcopy(existing), obj)
                _check_labels(merged)
                return 200, self._store_locked(kind, key, merged, "MODIFIED")
            meta = obj.setdefault("metadata", {})
            _check_labels(obj)
            if kind.plural == "resourceslices" and not status:
                problems = slice_problems(obj)
                if problems:
                    raise ApiError(422, "Invalid", "; ".join(problems[:5]))
                slice_defaults(obj, _now())
            if method == "POST":
                if name is not None:
                    raise ApiError(405, "MethodNotAllowed", "POST to a collection only")
                return 201, self._create_locked(kind, namespace, obj)
            # PUT: replace (the whole object, or only its status)
            existing = self._existing(key)
            wanted = meta.get("resourceVersion")
            if wanted and wanted != existing["metadata"]["resourceVersion"]:
                raise _conflict(kind, name)
            if status:
                replaced = copy.deepcopy(existing)
                replaced["status"] = obj.get("status")
            else:
                replaced = obj
                replaced["metadata"] = _updated_meta(existing["metadata"], meta)
                if kind.status:
                    replaced["status"] = existing.get("status")
            return 200, self._store_locked(kind, key, replaced, "MODIFIED")

    def _news(self, cut: int, since: int) -> bool:
        """Something for a watch at `since`: an event, a cut, or a compaction."""
        return (
            self._cut != cut
            or self._first_visible_after(since) is not None
            or since < self._compacted
        )

    def _existing(self, key: tuple[Kind, str, str]) -> Obj:
        found = self._objects.get(key)
        if found is None:
            raise ApiError(404, "NotFound", f'{key[0].plural} "{key[2]}" not found')
        return found

    @staticmethod
    def _decode(body: bytes) -> Obj:
        try:
            obj = json.loads(body or b"{}")
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"cannot decode the body: {exc}") from exc
        if not isinstance(obj, dict):
            raise ApiError(400, "BadRequest", "the body is not an object")
        return obj

    def _watch(
        self,
        handler: BaseHTTPRequestHandler,
        route: tuple[Kind, str, str | None, bool],
        query: dict[str, str],
        cut: int,
    ) -> None:
        kind, namespace, _, _ = route
        timeout = float(query.get("timeoutSeconds") or 300)
        deadline = time.monotonic() + timeout
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        with self._cond:
            since = int(query.get("resourceVersion") or self._version)
            gone = since < self._compacted
        if gone:
            _chunk(
                handler,
                {
                    "type": "ERROR",
                    "object": status_body(
                        410, "Expired", f"too old resource version: {since} ({self._compacted})"
                    ),
                },
            )
            _chunk_end(handler)
            return
        try:
            # `scanned`: the newest event looked at (of any kind), so events
            # this watch does not want are passed over once, not waited on.
            scanned = since
            while True:
                with self._cond:
                    first = self._first_visible_after(scanned)
                    fresh = (
                        []
                        if first is None
                        else [e for e in self._events[first:] if self._visible(e.version)]
                    )
                    pending = [
                        e for e in fresh
                        if e.kind is kind and self._matches(e.obj, kind, namespace, query)
                    ]  # fmt: skip
                    scanned = max([scanned, *(e.version for e in fresh)])
                    if not fresh:
                        self._cond.wait_for(
                            partial(self._news, cut, scanned),
                            timeout=max(0.0, deadline - time.monotonic()),
                        )
                    ended = (
                        self._cut != cut or time.monotonic() >= deadline or since < self._compacted
                    )
                for event in pending:
                    sent = _chunk(handler, {"type": event.type, "object": event.obj})
                    self._count(kind.plural, "watch", sent=sent, request=False)
                    since = event.version
                if ended and not pending:
                    break
            _chunk_end(handler)
        except (BrokenPipeError, ConnectionResetError):
            return


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away (its timeout, a stop) is not the server's error.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _conflict(kind: Kind, name: str | None) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {kind.plural} "{name}": '
        "the object has been modified; please apply your changes to the latest "
        "version and try again",
    )


# apimachinery pkg/util/validation/validation.go: a qualified name's part
# and a label value share this pattern; a key's prefix is a DNS subdomain.
_LABEL_PART = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _label_problem(key: str, value: Any) -> str | None:
    prefix, _, name = key.rpartition("/")
    if not name or len(name) > 63 or not _LABEL_PART.match(name):
        return f"metadata.labels: Invalid value: {key!r}: name part must be a qualified name"
    if prefix and (len(prefix) > 253 or not _SUBDOMAIN.match(prefix)):
        return f"metadata.labels: Invalid value: {key!r}: prefix must be a DNS subdomain"
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_PART.match(value):
        return (
            f"metadata.labels: Invalid value: {value!r}: a valid label must be 63 "
            "characters or less, alphanumeric at both ends"
        )
    return None


def _check_labels(obj: Obj) -> None:
    """Labels are validated on every write, as the API server does (422)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    if not isinstance(labels, dict):
        raise ApiError(422, "Invalid", "metadata.labels must be a map")
    for key, value in labels.items():
        problem = _label_problem(str(key), value)
        if problem is not None:
            raise ApiError(422, "Invalid", problem)


# What an update keeps of the stored metadata whatever the body says
# (apiserver pkg/registry/rest/update.go, BeforeUpdate): everything else in
# metadata (labels, annotations, owners, finalizers) is the body's, so a PUT
# that leaves out ownerReferences drops them.
_KEPT_ON_UPDATE = ("generation", "creationTimestamp", "deletionTimestamp")


def _updated_meta(stored: Obj, sent: Obj) -> Obj:
    meta = dict(sent)
    for field in _KEPT_ON_UPDATE:
        if field in stored:
            meta[field] = stored[field]
        else:
            meta.pop(field, None)
    meta.setdefault("uid", stored.get("uid"))
    if "deletionGracePeriodSeconds" in stored and "deletionGracePeriodSeconds" not in meta:
        meta["deletionGracePeriodSeconds"] = stored["deletionGracePeriodSeconds"]
    return meta


def _merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _verb(method: str, collection: bool, watch: bool) -> str:
    if watch:
        return "watch"
    if method == "GET":
        return "list" if collection else "get"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(
        method, method.lower()
    )


def _send(handler: BaseHTTPRequestHandler, code: int, body: Obj) -> int:
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
    return len(data)


def _chunk(handler: BaseHTTPRequestHandler, event: Obj) -> int:
    data = json.dumps(event).encode() + b"\n"
    handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    handler.wfile.flush()
    return len(data)


def _chunk_end(handler: BaseHTTPRequestHandler) -> None:
    handler.wfile.write(b"0\r\n\r\n")
    handler.wfile.flush()
