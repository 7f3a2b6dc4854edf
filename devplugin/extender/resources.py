"""The verbs for pods that ask for devices as extended resources:
POST /scheduler/filter (ExtenderArgs -> ExtenderFilterResult) and
POST /scheduler/prioritize (ExtenderArgs -> HostPriorityList, scores 0..10).
Both read the same per-node verdicts (verdicts.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress
from operator import attrgetter
from typing import Any

from devplugin.extender.args import chosen_models, filter_result, node_args, pod_kind
from devplugin.extender.liveness import Liveness
from devplugin.extender.nominations import Effect
from devplugin.extender.scores_json import HostScores
from devplugin.extender.serving import Verb
from devplugin.extender.verdicts import FAILED, NEVER, PASS, NodeVerdict, PodKind, Verdicts
from devplugin.policy.podinfo import PodInfo
from devplugin.policy.ranking import rank_list

_fit = attrgetter("fit")
_reason = attrgetter("reason")
_rank = attrgetter("rank")


class ResourceVerbs:
    def __init__(self, verdicts: Verdicts, liveness: Liveness, names: tuple[str, str]) -> None:
        self.verdicts = verdicts
        self.liveness = liveness
        self.gpu, self.hca = names
        self.host_scores = HostScores()

    def routes(self) -> dict[str, Verb]:
        return {"/scheduler/filter": self.filter, "/scheduler/prioritize": self.prioritize}

    def filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        pod, names, nodes = node_args(args)
        shape, requirement = pod_kind(pod, self.gpu, self.hca)
        # A GPU model no eviction changes: those nodes are unresolvable.
        names, unresolvable = chosen_models(pod, names, self.liveness.fresh())
        if not shape.wants_devices:
            return filter_result(list(names), {}, unresolvable, nodes)
        found = self.verdicts.of(pod, PodKind(shape, requirement, pod.priority), names)
        # Grouped by map() and compress() over the verdicts in the names'
        # order: a comprehension per group over 5,000 nodes was a fifth of a call.
        verdicts = list(map(found.__getitem__, names))
        fits = list(map(_fit, verdicts))
        passing = list(compress(names, map(PASS.__eq__, fits)))
        failed = _reasons(names, verdicts, list(map(FAILED.__eq__, fits)))
        unresolvable.update(_reasons(names, verdicts, list(map(NEVER.__eq__, fits))))
        return filter_result(passing, failed, unresolvable, nodes)

    def prioritize(self, args: Mapping[str, Any]) -> bytes:
        """The HostPriorityList, encoded (scores_json.py)."""
        pod, names, _ = node_args(args)
        shape, requirement = pod_kind(pod, self.gpu, self.hca)
        if not shape.wants_devices:
            return self.host_scores.encode(names, [0] * len(names))
        kind = PodKind(shape, requirement, pod.priority)
        # Computed once: the ranking and the hold it leaves must see the
        # same rooms spoken for.
        effects = self.verdicts.effects(pod, ranking=True)
        found = self.verdicts.of(pod, kind, names, effects=effects)
        keys = list(map(_rank, map(found.__getitem__, names)))
        scores = rank_list(keys)
        self._hold(pod, kind, names, scores, effects)
        return self.host_scores.encode(names, scores)

    def _hold(
        self,
        pod: PodInfo,
        kind: PodKind,
        names: list[str],
        scores: list[int],
        effects: Mapping[str, Effect],
    ) -> None:
        """Where one node ranks first alone, the scheduler will most likely
        assume the pod there: its devices there are held in the rankings of
        the pods asked about before the binding shows (holds.py)."""
        holds = self.verdicts.holds
        if holds is None:
            return
        best = max(scores, default=0)
        first = [name for name, score in zip(names, scores, strict=True) if score == best]
        if best == 0 or len(first) != 1:
            holds.unranked(pod.uid)
            return
        placed = self.verdicts.placement(pod, kind, first[0], effects.get(first[0], Effect()))
        holds.ranked(pod, first[0], placed)


def _reasons(
    names: Sequence[str], verdicts: Sequence[NodeVerdict], chosen: Sequence[bool]
) -> dict[str, str]:
    """Name -> reason of the verdicts `chosen` marks."""
    reasons = map(_reason, compress(verdicts, chosen))
    return dict(zip(compress(names, chosen), reasons, strict=True))
