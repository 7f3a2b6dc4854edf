"""The verbs for pods that ask for devices through ResourceClaims (with
--dra): POST /scheduler/claims/filter and /scheduler/claims/prioritize.

The scheduler calls an extender whose `managedResources` is set only for
pods that request one of them (HTTPExtender.IsInterested), so the chart
names this one without: it is asked about every pod and answers at once
(everything passes, every score 0) for one without claims. For a pod with
claims it predicts, node by node, what the allocator will pick
(dra_views.py), filters out nodes where that is nothing, and ranks the
rest by the worst GPU+HCA pair of that choice, then the sum over pairs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from devplugin.extender.answers import Answers
from devplugin.extender.args import chosen_models, filter_result, node_args
from devplugin.extender.dra_views import DraCaches, DraViews, pod_claims
from devplugin.extender.liveness import Liveness
from devplugin.extender.scores_json import HostScores
from devplugin.extender.serving import Verb
from devplugin.extender.verdicts import FAILED, PASS, UNTOLD, NodeVerdict
from devplugin.policy.dra_predict import Prediction
from devplugin.policy.ranking import rank_list

CLAIMS_REFUSED = "devplugin: the pod's ResourceClaims cannot be allocated here"


def claim_verdict(prediction: Prediction | None) -> NodeVerdict:
    if prediction is None:
        return UNTOLD  # never block on what cannot be told
    if not prediction.fits:
        return NodeVerdict(FAILED, CLAIMS_REFUSED, None, None, math.inf)
    return NodeVerdict(PASS, "", prediction.key(), None, math.inf)


class ClaimVerbs:
    def __init__(
        self,
        dra: tuple[DraViews, DraCaches] | None,
        liveness: Liveness,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Without `dra` (no --dra), every pod counts as one without claims."""
        self.dra = dra
        self.liveness = liveness
        self.answers: Answers[NodeVerdict] | None = (
            Answers(dra[0].changes, clock) if dra is not None else None
        )
        self.host_scores = HostScores()

    def routes(self) -> dict[str, Verb]:
        return {
            "/scheduler/claims/filter": self.filter,
            "/scheduler/claims/prioritize": self.prioritize,
        }

    def filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """A node passes unless the allocator's walk there finds nothing for
        the pod's claims."""
        pod, names, nodes = node_args(args)
        names, unresolvable = chosen_models(pod, names, self.liveness.fresh())
        found = self._verdicts(args, names)
        failed = {name: CLAIMS_REFUSED for name in names if found.get(name, UNTOLD).fit == FAILED}
        passing = [name for name in names if name not in failed]
        return filter_result(passing, failed, unresolvable, nodes)

    def prioritize(self, args: Mapping[str, Any]) -> bytes:
        """By the worst pair, then the sum over pairs, of what the allocator
        will pick on each node."""
        _, names, _ = node_args(args)
        found = self._verdicts(args, names)
        keys = [found.get(name, UNTOLD).rank for name in names]
        return self.host_scores.encode(names, rank_list(keys))

    def _verdicts(self, args: Mapping[str, Any], names: list[str]) -> dict[str, NodeVerdict]:
        """Nothing (every node passes, score 0) for a pod without claims or
        with one not known."""
        if self.dra is None or self.answers is None:
            return {}
        views, caches = self.dra
        claims = pod_claims(args["Pod"], caches.claims)
        if not claims:
            return {}
        key = "\n".join(claim.spec_key for claim in claims)

        def compute(missing: Sequence[str]) -> dict[str, tuple[NodeVerdict, float]]:
            predictions = views.predictions(missing, claims)
            return {name: (claim_verdict(p), math.inf) for name, p in predictions.items()}

        found, _ = self.answers.read(key, names, compute)
        return found
