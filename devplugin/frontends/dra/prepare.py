"""NodePrepareResources and NodeUnprepareResources, behind the gRPC layer.

Prepare, for one claim: read the ResourceClaim (bounded), check it is the
claim the kubelet means (its uid), take the allocation results for this
driver and this node's pool, and map each device name back to the node's
device. Then, in this order:

1. take the devices (one step of the claim ledger): refuse a device
   another claim holds, wait for the cleanup of any device still owed one,
   then record the claim as started, with its devices in use, in the
   checkpoint;
2. refuse a device that is unhealthy for any other reason (the take is
   undone; nothing ran on the devices);
3. run the init hooks;
4. write the claim's CDI spec: each device's own nodes (with the nodes
   every device of its kind needs), one variables-only device per request
   (`NVIDIA_VISIBLE_DEVICES`, `NCCL_IB_HCA` listing that request's devices)
   and, when a kind has several requests, one for the whole claim. Nothing
   is spec-wide: a container that names one request gets only its devices
   and its variables;
5. record the claim as completed in this boot, with what each device was
   answered.

A failure after 2 rolls back: the spec goes, the claim is forgotten and its
devices are owed a cleanup (the init hook may have half run), so they are
not offered again until clean. A daemon killed between 1 and 5 finds the
claim started at its next start and rolls it back the same way; the
kubelet, which got no answer, asks again, and the prepare is redone.

Nothing waits past the kubelet's deadline (taken from the call; 45 s when
a call carries none). A prepare waits for a cleanup, or for an earlier call
of its own claim, at most half the time left, leaving the rest to its init
hooks; then it answers with an error naming the device and the cleanup, and
the kubelet asks again. Only `max_waiting` calls wait at once, so the gRPC
workers left answer other claims at once whatever those wait for.

A claim already completed in this boot, whose spec is still there, answers
what it answered before; one completed before a reboot (the spec went with
/var/run/cdi, the devices were reset) is prepared again. Unprepare of a
claim this node does not know is success (it may have been rolled back, or
never prepared here).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from devplugin.frontends.dra.claim_record import ClaimDevice, ClaimRecord
from devplugin.frontends.dra.ledger import ClaimLedger
from devplugin.frontends.dra.slices import names as slice_names
from devplugin.frontends.dra.slices import node_devices
from devplugin.model import DeviceKind, Health, Refused
from devplugin.node.lifecycle.cdi_spec import ClaimSpecs
from devplugin.node.lifecycle.custody import WAIT_SHARE, Problem, wait_until
from devplugin.node.lifecycle.devices import describe
from devplugin.node.lifecycle.hooks import HookRunner, HookSpec
from devplugin.node.metrics import Metrics
from devplugin.node.pipeline import Pipeline
from devplugin.node.resources import DeviceNode, Resource
from devplugin.policy.cdi import ClaimNode, claim_spec, qualified
from devplugin.policy.claims import ClaimReader, ClaimReadError, claim_uid, results_for

log = logging.getLogger(__name__)

# The kubelet's deadline for a DRA call (defaultClientCallTimeout), for a
# call that carries none.
DEFAULT_DEADLINE = 45.0
# Calls that may wait at once (the DRA socket has 8 gRPC workers).
MAX_WAITING = 4


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class InitHooks:
    """The init hook of each kind that has one, and what runs them."""

    runner: HookRunner
    specs: Mapping[DeviceKind, HookSpec]


@dataclass(frozen=True)
class Seat:
    """Where claims are prepared: the driver's name, its pool (this node)
    and the boot they are prepared in (a claim recorded in another boot
    was prepared before a reboot)."""

    driver: str
    pool: str
    boot: str = ""


class Preparer:
    def __init__(
        self,
        *,
        seat: Seat,
        resources: Mapping[DeviceKind, Resource],
        pipeline: Pipeline,
        ledger: ClaimLedger,
        init: InitHooks,
        specs: ClaimSpecs,
        reader: ClaimReader,
        metrics: Metrics | None = None,
        max_waiting: int = MAX_WAITING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.driver = seat.driver
        self.pool = seat.pool
        self._resources = dict(resources)
        self._pipeline = pipeline
        self._ledger = ledger
        self._runner = init.runner
        self._init = dict(init.specs)
        self._specs = specs
        self._reader = reader
        self._kinds = frozenset(resources)
        self._metrics = metrics
        if metrics is not None:
            metrics.dra_prepared.set_function(lambda: float(len(ledger.claims())))
        # One call at a time per claim (a retry waits for the first), but
        # claims do not wait for each other: a slow init hook of one never
        # holds up another's prepare. Two claims naming one device cannot
        # both get it: the ledger's begin checks and records holders atomically.
        self._guard = threading.Lock()
        self._claim_locks: dict[str, tuple[threading.Lock, int]] = {}
        self._waiting = threading.BoundedSemaphore(max_waiting)
        self._clock = clock
        self._boot = seat.boot

    def _names(self) -> dict[str, tuple[DeviceKind, str]]:
        """The devices as the slices name them (what a claim's results name)."""
        return slice_names(node_devices(self._pipeline.inventory, self._kinds))

    def held(self) -> frozenset[str]:
        """The devices of this pool that claims hold, as slices name them
        (the slices' free counts; the rejudge after a take or a release
        makes the publisher compare them again)."""
        return frozenset(
            device.device
            for claim in self._ledger.claims()
            for device in claim.devices
            if device.pool == self.pool and not device.admin
        )

    @property
    def kinds(self) -> Collection[DeviceKind]:
        return self._resources.keys()

    @property
    def untrusted(self) -> bool:
        return self._ledger.untrusted

    @contextlib.contextmanager
    def _claim_lock(self, uid: str, until: float) -> Iterator[None]:
        """The claim's own lock, waited for until `until` at most."""
        with self._guard:
            lock, users = self._claim_locks.get(uid, (threading.Lock(), 0))
            self._claim_locks[uid] = (lock, users + 1)
        try:
            if not lock.acquire(timeout=max(0.0, until - self._clock())):
                raise Refused(
                    f"claim {uid}: an earlier call for it is still running; try again",
                    invalid_argument=False,
                )
            try:
                yield
            finally:
                lock.release()
        finally:
            with self._guard:
                lock, users = self._claim_locks[uid]
                if users == 1:
                    del self._claim_locks[uid]
                else:
                    self._claim_locks[uid] = (lock, users - 1)

    # -- the two calls ---------------------------------------------------------
    @contextlib.contextmanager
    def _wait_budget(self, deadline: float | None) -> Iterator[float]:
        """Until when this call may wait: a share of the time left, when one
        of the waiting places is free, else not at all."""
        now = self._clock()
        if not self._waiting.acquire(blocking=False):
            yield now
            return
        try:
            yield wait_until(now, deadline, DEFAULT_DEADLINE * WAIT_SHARE)
        finally:
            self._waiting.release()

    def prepare(
        self, ref: ClaimRef, deadline: float | None = None
    ) -> tuple[tuple[ClaimDevice, ...], str]:
        """(devices, "") or ((), why not), before `deadline` (monotonic)."""
        started = time.monotonic()
        again = False
        with self._wait_budget(deadline) as until:
            try:
                with self._claim_lock(ref.uid, until):
                    known = self._ledger.claim(ref.uid)
                    again = known is not None and known.completed and self._current(known)
                    devices, error = self._prepare_guarded(ref, until)
            except Refused as exc:
                log.warning("claim %s not prepared: %s", ref, exc.reason)
                devices, error = (), exc.reason
        if self._metrics is not None:
            result = "error" if error else "again" if again else "ok"
            self._metrics.dra_claims.labels("prepare", result).inc()
            if not again:
                self._metrics.dra_prepare_seconds.observe(time.monotonic() - started)
        return devices, error

    def _prepare_guarded(self, ref: ClaimRef, until: float) -> tuple[tuple[ClaimDevice, ...], str]:
        try:
            return self._prepare(ref, until), ""
        except Refused as exc:
            log.warning("claim %s not prepared: %s", ref, exc.reason)
            return (), exc.reason
        except Exception as exc:
            # A bug must not fail the other claims of the call: this
            # claim's error, with what rolled back.
            log.exception("claim %s: prepare failed", ref)
            known = self._ledger.claim(ref.uid)
            if known is not None and not known.completed:
                self._roll_back(known, "rolled back after an internal error")
            return (), f"internal error: {type(exc).__name__}: {exc}"[:500]

    def unprepare(self, ref: ClaimRef, deadline: float | None = None) -> str:
        claim = None
        with self._wait_budget(deadline) as until:
            try:
                with self._claim_lock(ref.uid, until):
                    claim = self._ledger.claim(ref.uid)
                    if claim is not None:
                        self._roll_back(claim, "unprepared")
            except Refused as exc:
                if self._metrics is not None:
                    self._metrics.dra_claims.labels("unprepare", "error").inc()
                return exc.reason
        if self._metrics is not None:
            self._metrics.dra_claims.labels("unprepare", "ok" if claim else "again").inc()
        return ""

    # -- at start --------------------------------------------------------------
    def recover(self) -> None:
        """Roll back claims a killed daemon left started, and remove CDI
        specs of claims this node no longer knows (before serving)."""
        with self._guard:
            for claim in self._ledger.claims():
                if not claim.completed:
                    log.warning(
                        "claim %s/%s (%s) was being prepared when the daemon stopped; "
                        "rolling it back (its devices are cleaned before reuse)",
                        claim.namespace,
                        claim.name,
                        claim.uid,
                    )
                    self._roll_back(claim, "rolled back")
            known = {claim.uid for claim in self._ledger.claims()}
            for uid in sorted(self._specs.on_disk() - known):
                problem = self._specs.remove(uid)
                if problem:
                    log.warning("%s", problem)
                else:
                    log.info("removed the CDI spec of unknown claim %s", uid)

    def adopt(self) -> None:
        """Without a trustworthy checkpoint: the claims the API server says
        hold this pool's devices are taken as prepared; every other device is
        cleaned before it is offered. Raises ClaimReadError."""
        claims = self._reader.on_node(self.driver, self.pool)
        names = self._names()
        with self._guard:
            for claim in claims:
                meta = claim.get("metadata") or {}
                try:
                    results = results_for(claim, self.driver)
                except ValueError:
                    continue
                devices = []
                for result in results:
                    found = names.get(result.device) if result.pool == self.pool else None
                    if found is not None and found[0] in self._resources:
                        devices.append(
                            ClaimDevice(
                                found[0], found[1], result.pool, result.device, (result.request,)
                            )
                        )
                if devices:
                    self._ledger.adopt(
                        ClaimRecord(
                            claim_uid(claim),
                            str(meta.get("namespace", "")),
                            str(meta.get("name", "")),
                            tuple(devices),
                            completed=True,
                        )
                    )
            released = self._ledger.release_unclaimed(list(self._resources))
        log.info(
            "no trustworthy checkpoint: %d claims hold devices of this node; %d devices "
            "held by none are cleaned before they are offered",
            len(claims),
            released,
        )

    # -- the steps -----------------------------------------------------------------
    def _prepare(self, ref: ClaimRef, until: float) -> tuple[ClaimDevice, ...]:
        known = self._ledger.claim(ref.uid)
        if known is not None and known.completed:
            if self._current(known):
                return known.devices
            # Completed in another boot (or its spec is gone): the spec went
            # with /var/run/cdi and the devices were reset. Prepared again,
            # its devices still its own (the take finds them held by it).
            log.info("claim %s was prepared before a reboot; preparing it again", ref)
        elif known is not None:
            self._roll_back(known, "rolled back (found half prepared)")
        devices = self._devices(ref)
        if not devices:
            return ()
        started = ClaimRecord(ref.uid, ref.namespace, ref.name, devices, boot=self._boot)
        problem = self._ledger.begin(started, wait_until=until)
        if problem is not None:
            raise Refused(_named(problem, devices), invalid_argument=False)
        self._check_healthy(ref, devices)
        try:
            answered = self._run(ref, devices)
        except Refused:
            self._roll_back(started, "rolled back after a failed prepare")
            raise
        done = ClaimRecord(ref.uid, ref.namespace, ref.name, answered, True, self._boot)
        error = self._ledger.complete(done)
        if error is not None:
            self._roll_back(started, "rolled back (completion not recorded)")
            raise Refused(error, invalid_argument=False)
        log.info("claim %s prepared: %s", ref, ", ".join(device.device for device in answered))
        return answered

    def _current(self, claim: ClaimRecord) -> bool:
        """Whether a completed claim's answer still holds: completed in this
        boot (a record from before boot ids were kept counts as this boot's)
        and its spec still there."""
        if claim.boot and claim.boot != self._boot:
            return False
        return self._specs.exists(claim.uid)

    def _devices(self, ref: ClaimRef) -> tuple[ClaimDevice, ...]:
        try:
            claim = self._reader.get(ref.namespace, ref.name)
        except ClaimReadError as exc:
            raise Refused(
                f"reading ResourceClaim {ref.namespace}/{ref.name}: {exc}", invalid_argument=False
            ) from exc
        if claim is None:
            raise Refused(
                f"ResourceClaim {ref.namespace}/{ref.name} not found", invalid_argument=False
            )
        uid = claim_uid(claim)
        if uid != ref.uid:
            raise Refused(
                f"ResourceClaim {ref.namespace}/{ref.name} has uid {uid}, not {ref.uid} "
                "(it was replaced)",
                invalid_argument=False,
            )
        try:
            results = results_for(claim, self.driver)
        except ValueError as exc:
            raise Refused(
                f"ResourceClaim {ref.namespace}/{ref.name}: {exc}", invalid_argument=False
            ) from exc
        names = self._names()
        by_device: dict[str, list[str]] = {}
        # A device all of whose results have admin access (upstream never
        # gives one claim a device twice, so this is one result).
        admin: dict[str, bool] = {}
        for result in results:
            if result.pool != self.pool:
                raise Refused(
                    f"device {result.device} is in pool {result.pool}, "
                    f"not this node's ({self.pool})",
                    invalid_argument=False,
                )
            found = names.get(result.device)
            if found is None or found[0] not in self._resources:
                raise Refused(
                    f"device {result.device} is not on this node now", invalid_argument=False
                )
            requests = by_device.setdefault(result.device, [])
            if result.request not in requests:
                requests.append(result.request)
            admin[result.device] = admin.get(result.device, True) and result.admin
        return tuple(
            ClaimDevice(
                names[device][0],
                names[device][1],
                self.pool,
                device,
                tuple(requests),
                admin=admin[device],
            )
            for device, requests in by_device.items()
        )

    def _check_healthy(self, ref: ClaimRef, devices: Sequence[ClaimDevice]) -> None:
        """After the take: refuse a device unhealthy for another reason than
        its custody (a fault, a port down), undoing the take; nothing ran."""
        self._pipeline.rejudge()
        for device in devices:
            state = self._pipeline.served(device.kind)
            judged = state.device(device.id) if state is not None else None
            problem = None
            if judged is None:
                problem = f"device {device.device} is not served now"
            elif judged.health is not Health.HEALTHY:
                problem = f"device {device.device} is unhealthy: {judged.reason}"
            if problem is not None:
                self._ledger.end(ref.uid, dirty=False)
                self._pipeline.rejudge()
                raise Refused(problem, invalid_argument=False)

    def _init_hooks(self, per_kind: Mapping[DeviceKind, Sequence[ClaimDevice]]) -> None:
        """Each kind's init hook on its devices; Refused when one fails."""
        inventory = self._pipeline.inventory
        for kind, chosen in per_kind.items():
            spec = self._init.get(kind)
            # No init on a device given with admin access: another pod may
            # be using it, and this claim takes no custody of it.
            ids = [device.id for device in chosen if not device.admin]
            if spec is None or not ids:
                continue
            described = describe(inventory, kind, ids)
            if described is None:
                raise Refused("a device left the node during prepare", invalid_argument=False)
            result = self._runner(
                spec,
                "init",
                self._resources[kind].name,
                described,
                track=self._ledger.tracker(kind, ids),
                cancel=self._ledger.cancel,
            )
            if not result.ok:
                raise Refused(result.describe("init", spec.timeout), invalid_argument=False)

    def _run(self, ref: ClaimRef, devices: Sequence[ClaimDevice]) -> tuple[ClaimDevice, ...]:
        """Init hooks, then the CDI spec; the devices with their CDI ids."""
        per_kind = {
            kind: [device for device in devices if device.kind is kind] for kind in self._resources
        }
        self._init_hooks(per_kind)
        states = {}
        nodes: dict[str, list[ClaimNode]] = {}
        extra: dict[str, tuple[str, ...]] = {}
        for kind, chosen in per_kind.items():
            if not chosen:
                continue
            state = self._pipeline.served(kind)
            if state is None:
                raise Refused(f"no {kind.value} is served now", invalid_argument=False)
            states[kind] = state
            # The nodes every device of the kind needs go with each device,
            # so a container that gets no device of the kind gets none.
            shared = [_claim_node(node) for node in state.shared_nodes]
            for device in chosen:
                own = state.allocations.get(device.id)
                mine = [_claim_node(node) for node in (own.devices if own is not None else ())]
                nodes[_own_name(ref.uid, device)] = list(dict.fromkeys([*mine, *shared]))
                # The vendor's own CDI names (a GPU's driver libraries), when
                # the resource delivers by CDI.
                extra[device.device] = own.cdi_devices if own is not None else ()

        def variables_of(chosen: Sequence[ClaimDevice]) -> dict[str, str]:
            env: dict[str, str] = {}
            for kind, state in states.items():
                ids = [device.id for device in chosen if device.kind is kind]
                if ids:
                    env.update(self._resources[kind].allocate(state, ids).envs)
            return env

        by_request: dict[str, list[ClaimDevice]] = {}
        for device in devices:
            for request in device.requests:
                by_request.setdefault(request, []).append(device)
        per_request = {request: variables_of(chosen) for request, chosen in by_request.items()}
        variables = {_request_name(ref.uid, r): env for r, env in per_request.items()}
        # A container naming the whole claim gets every request's variables,
        # and a later one overwrites an earlier of the same name: when a kind
        # has several requests, the claim's own variables come last for it.
        requests_of_kind = Counter(
            kind for chosen in by_request.values() for kind in {d.kind for d in chosen}
        )
        whole = variables_of(devices) if max(requests_of_kind.values(), default=0) > 1 else {}
        if whole:
            variables[_whole_name(ref.uid)] = whole
        document = claim_spec(self._specs.kind, nodes, variables)
        try:
            self._specs.write(ref.uid, document)
        except OSError as exc:
            raise Refused(
                f"CDI spec {self._specs.path(ref.uid)} not written: {exc.strerror or exc}",
                invalid_argument=False,
            ) from exc
        kind_of = self._specs.kind
        answered = []
        for index, device in enumerate(devices):
            ids = [qualified(kind_of, _own_name(ref.uid, device))]
            ids.extend(
                qualified(kind_of, _request_name(ref.uid, request))
                for request in device.requests
                if per_request.get(request)
            )
            last = index == len(devices) - 1
            answered.append(
                replace(
                    device,
                    cdi_ids=(*ids, *extra[device.device]),
                    whole=(qualified(kind_of, _whole_name(ref.uid)),) if whole and last else (),
                )
            )
        return tuple(answered)

    def _roll_back(self, claim: ClaimRecord, why: str) -> None:
        problem = self._specs.remove(claim.uid)
        if problem:
            log.warning("%s", problem)
        self._ledger.end(claim.uid)
        self._pipeline.rejudge()
        log.info("claim %s/%s (%s) %s", claim.namespace, claim.name, claim.uid, why)


def _named(problem: Problem, devices: Sequence[ClaimDevice]) -> str:
    """The problem with its device named as the claim names it."""
    for device in devices:
        if device.id == problem.device:
            return problem.named(f"device {device.device}")
    return str(problem)


def _claim_node(node: DeviceNode) -> ClaimNode:
    return ClaimNode(node.container_path, node.host_path, node.permissions, node.number)


# CDI device names in a claim's spec. The claim uid starts each, so a
# runtime that cached another claim's spec never confuses the two; slice
# device names never start with "request-" nor are "claim".
def _own_name(uid: str, device: ClaimDevice) -> str:
    return f"{uid}-{device.device}"


def _request_name(uid: str, request: str) -> str:
    return f"{uid}-request-{request}"


def _whole_name(uid: str) -> str:
    return f"{uid}-claim"
