"""The lifecycle around one resource's allocations (the servicer's AllocationHooks).

Before: the devices are taken into custody; one still owed a cleanup is
cleaned first (its cleanup asked for now and waited for, within the
caller's deadline). Then, optionally, attach mode adds the nearest HCAs to
a GPU container and the init hook runs. After: the allocation is recorded
once, in the ledger, and the pairing and cleanup bookkeeping advance; an
Allocate that failed gives its devices back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from devplugin.model import DeviceKind, Refused
from devplugin.node.coordination import Coordinator
from devplugin.node.hca.resource import HcaResource
from devplugin.node.ledger import ContainerKey, Ledger
from devplugin.node.lifecycle.custody import wait_until
from devplugin.node.lifecycle.devices import describe
from devplugin.node.lifecycle.hooks import HookRunner, HookSpec
from devplugin.node.lifecycle.takes import Takes
from devplugin.node.pipeline import Pipeline
from devplugin.node.resources import ContainerAllocation, Resource

log = logging.getLogger(__name__)

# Without a deadline (the kubelet sets none on Allocate), a wait ends this
# long after the cleanup hook's own timeout, by when the hook was killed.
KILL_GRACE = 5.0

# Which container (and its pod's uid) an Allocate was for, when the pod cache can tell.
# (kind, devices, the resource's name) -> the container an Allocate is for.
Identify = Callable[[DeviceKind, Sequence[str], str], tuple[ContainerKey, str] | None]


class ResourceHooks:
    def __init__(
        self,
        resource: Resource,
        *,
        pipeline: Pipeline,
        ledger: Ledger,
        coordinator: Coordinator,
        takes: Takes,
        runner: HookRunner,
        init: HookSpec | None = None,
        attach: HcaResource | None = None,
        poke: Callable[[], None] = lambda: None,
        identify: Identify | None = None,
    ) -> None:
        self._resource = resource
        self._kind = resource.kind
        self._pipeline = pipeline
        self._ledger = ledger
        self._coordinator = coordinator
        self._takes = takes
        self._runner = runner
        self._init = init
        self._pre_start = resource.capabilities.pre_start
        self._attach = attach
        self._poke = poke
        self._identify = identify

    def take(self, physical: Sequence[str], deadline: float | None) -> None:
        otherwise = self._takes.cleanup_timeout(self._kind) + KILL_GRACE
        until = wait_until(time.monotonic(), deadline, otherwise)
        problem = self._takes.take(
            self._kind,
            physical,
            shared=not self._resource.reuse_proves_release,
            wait_until=until,
        )
        if self._takes.cleans(self._kind):
            # A device cleaned meanwhile is Healthy again: judge before validating.
            self._pipeline.rejudge()
        if problem is not None:
            raise Refused(str(problem), invalid_argument=False, retry=problem.retry)

    def abandon(self, physical: Sequence[str], *, dirty: bool) -> None:
        self._takes.abandon(self._kind, physical, dirty=dirty)
        if self._takes.cleans(self._kind):
            self._pipeline.rejudge()

    def extra(self, physical: Sequence[str]) -> ContainerAllocation | None:
        """Attach mode: the nearest healthy HCAs' nodes and variable for these GPUs."""
        if self._attach is None:
            return None
        state = self._pipeline.hca_state()
        hcas = self._coordinator.nearest(physical)
        if state is None or not hcas:
            return None
        try:
            return self._attach.allocate(state, hcas)
        except Refused as exc:
            log.warning("attach: cannot add HCAs %s: %s", ",".join(hcas), exc.reason)
            return None

    def init(self, physical: Sequence[str]) -> str | None:
        return None if self._pre_start else self._run_init(physical)

    def pre_start(self, physical: Sequence[str]) -> str | None:
        return self._run_init(physical) if self._pre_start else None

    def _run_init(self, physical: Sequence[str]) -> str | None:
        spec = self._init
        if spec is None:
            return None
        name = self._resource.name
        devices = describe(self._pipeline.inventory, self._kind, physical)
        if devices is None:
            return "unknown device ids"
        result = self._runner(
            spec,
            "init",
            name,
            devices,
            track=self._takes.tracker(self._kind, physical),
            cancel=self._takes.cancel,
        )
        if result.ok:
            log.info("%s: init hook for %s took %.2fs", name, ",".join(physical), result.duration)
            return None
        message = result.describe("init", spec.timeout)
        log.warning("%s: %s for %s", name, message, ",".join(physical))
        return message

    def allocated(self, physical: Sequence[str]) -> None:
        identify = self._identify
        found = (
            identify(self._kind, physical, self._resource.name) if identify is not None else None
        )
        holder, uid = found if found is not None else (None, None)
        self._ledger.allocated(self._kind, physical, holder=holder, uid=uid)
        self._coordinator.allocated(self._kind, physical)
        owner = (holder[0], holder[1], uid) if holder is not None else None
        self._takes.allocated(self._kind, physical, owner)
        # A PodResources poll soon (rate-limited, on the monitor's thread).
        self._poke()
