"""The fold: the best value of every count taken in every subtree, bottom up
over the device tree, then the counts that reach the best value at the
root, top down. Pure (it reads fold_tables.py's rows and adds them).

One fold serves every topology. A subtree's table holds one row per state,
a row being the best value for each count taken below (`inf` or more than
half of it: no such choice). Where the tree expresses every GPU pair's
score, the only state is the empty one and a merge is one (min, +)
convolution, done in C by map() over whole rows. Where NVLinks cross the
tree (DGX-1's hybrid cube mesh, bridges between switches), a state is how
many devices were taken from each class whose NVLinks still leave the part
merged so far (`LinkedPlan`); a merge that brings both ends of a link
together adds its score and drops the class from the state.

The compiled fold (_foldc.c) is this fold for the empty state only, step
for step; the tests compare the two on thousands of cases.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import chain, repeat, zip_longest
from operator import add

from devplugin.policy.fold_tables import (
    FINISH_CACHED,
    FoldTables,
    Inputs,
    KindTables,
    LinkedPlan,
    Step,
)
from devplugin.policy.objective import Request

State = tuple[int, ...]
Table = dict[State, list[int]]

# A class or subtree that takes nothing, at no cost (never mutated).
NOTHING: list[int] = [0]


class OutOfTime(Exception):
    """A fold with a deadline passed it."""


def convolve(first: list[int], second: list[int], low: int, high: int, inf: int) -> list[int]:
    """out[s] = min over a + b = s of first[a] + second[b], for s <= high
    (both at least two long); slots under `low` may be left infinite (nobody
    needs them). Whole rows go through map() so the inner loop runs in C."""
    if len(second) == 2 or len(first) == 2:
        if len(second) != 2:
            first, second = second, first
        zero, one = second
        out = list(
            map(
                min,
                chain(map(add, first, repeat(zero)), (inf,)),
                chain((inf,), map(add, first, repeat(one))),
            )
        )
        del out[high + 1 :]
        return out
    out = [inf] * (high + 1)
    half = inf >> 1
    width = len(first)
    if low <= 0 and high == width + len(second) - 2:
        # Every slot wanted: each row lands whole.
        for taken, value in enumerate(second):
            if value < half:
                to = taken + width
                out[taken:to] = map(min, out[taken:to], map(add, first, repeat(value)))
        return out
    for taken, value in enumerate(second):
        if value >= half:
            continue
        start, stop = max(low - taken, 0), min(width, high - taken + 1)
        if start < stop:
            at, to = start + taken, stop + taken
            out[at:to] = map(min, out[at:to], map(add, first[start:stop], repeat(value)))
    return out


@dataclass(frozen=True)
class _Merge:
    """One item folded into a node, kept for the walk back."""

    is_class: bool
    item: int
    table: Table  # the item's
    before: Table  # the node's, before this item
    merged: Table  # the node's, after it
    # Per merged state: (state before, item state, link value subtracted),
    # in the order they were tried.
    sources: dict[State, list[tuple[State, State, int]]]

    def source(self, state: State, k: int) -> tuple[State, State, int]:
        """Which states, and how many of the item, gave the best value for
        `k` in `state`: the first pair tried that reaches it, with the most
        of the item (the forward pass kept the first minimum it met)."""
        goal = self.merged[state][k]
        for s1, s2, link in self.sources[state]:
            row, before = self.table[s2], self.before[s1]
            take = min(k, len(row) - 1)
            while take >= 0 and k - take < len(before):
                if before[k - take] + row[take] - link == goal:
                    return s1, s2, take
                take -= 1
        raise AssertionError("the walk back lost the best value")  # pragma: no cover


class _Fold:
    """One fold of one request at one threshold (see the module doc)."""

    def __init__(
        self,
        tables: FoldTables,
        kind: KindTables,
        plan: LinkedPlan | None,
        request: Request,
        deadline: float | None,
    ) -> None:
        self._kind, self._plan = kind, plan
        self._size = request.size
        self._inf = tables.weights.inf
        self._w_conn = tables.weights.connectivity
        self._deadline = deadline
        self.merges: list[list[_Merge]] = [[] for _ in tables.topology.nodes]

    def class_table(self, c: int, inputs: Inputs, prune_above: int) -> Table:
        """A class's table: the value of each count of it (must-include
        devices first); one state per count where its NVLinks leave it."""
        opened = self._plan is not None and self._plan.open_class[c]
        cap, need, per = inputs.cap[c], inputs.must[c], inputs.cost[c]
        if not cap:
            return {(0,): NOTHING} if opened else {(): NOTHING}
        inf = self._inf
        if 0 <= prune_above < per:
            row = NOTHING if not need else [inf]
        else:
            row = self._kind.class_values[c][per][: min(cap, self._size) + 1]
            if need:
                row = [inf] * need + row[need:]
        if not opened:
            return {(): row}
        half = inf >> 1
        return {(k,): [inf] * k + [value] for k, value in enumerate(row) if value < half}

    def merge(
        self, step: Step, current: Table, table: Table, rest: int, merges: list[_Merge]
    ) -> Table:
        """Fold one item's table into the node's so far. `rest`: how many
        the classes outside the part merged after this could take at most
        (counts they could not make up to the size are never used)."""
        inf, size = self._inf, self._size
        low = size - rest
        edges, w_conn, deadline = step.edges, self._w_conn, self._deadline
        # An opened class's rows each hold one count (the last entry): the
        # merge is a shift, not a convolution.
        single = step.is_class and self._plan is not None and self._plan.open_class[step.item]
        merged: Table = {}
        sources: dict[State, list[tuple[State, State, int]]] = {}
        for s1, row1 in current.items():
            # One row of pairs is at most a few thousand steps.
            if deadline is not None and time.monotonic() > deadline:
                raise OutOfTime
            for s2, row2 in table.items():
                link = sum(w * s1[i] * s2[j] for i, j, w in edges) * w_conn if edges else 0
                joined = s1 + s2
                state = joined if step.keeps_all else tuple([joined[i] for i in step.keep])
                if row1 is NOTHING:
                    out = row2  # the first item that can take something, as it is
                elif single:
                    k, value = len(row2) - 1, row2[-1] - link
                    out = [inf] * k + [x + value for x in row1[: size - k + 1]]
                else:
                    high = min(size, len(row1) + len(row2) - 2)
                    out = convolve(row1, row2, low, high, inf)
                if link and not single:
                    out = [value - link for value in out]
                sources.setdefault(state, []).append((s1, s2, link))
                best = merged.get(state)
                if best is None:
                    merged[state] = out
                elif len(best) == len(out):
                    merged[state] = list(map(min, best, out))
                else:
                    merged[state] = [min(a, b) for a, b in zip_longest(best, out, fillvalue=inf)]
        merges.append(_Merge(step.is_class, step.item, table, current, merged, sources))
        return merged

    def steps(self, node: int, children: tuple[int, ...], mine: tuple[int, ...]) -> list[Step]:
        if self._plan is not None:
            return list(self._plan.steps[node])
        items = [(False, child) for child in children] + [(True, c) for c in mine]
        return [Step(is_class, item, (), (), True) for is_class, item in items]


def fold(
    tables: FoldTables,
    request: Request,
    threshold: int,
    inputs: Inputs,
    *,
    plan: LinkedPlan | None = None,
    deadline: float | None = None,
) -> tuple[int, dict[int, int]] | None:
    """The best value of `request.size` devices at this threshold and the
    count of each class that gives it; None when there is none. `plan`: the
    NVLinks the tree cannot express (GPU requests). Raises OutOfTime past
    `deadline`."""
    kind = tables.kinds[request.kind] if plan is None else tables.linked_kind
    assert kind is not None
    run = _Fold(tables, kind, plan, request, deadline)
    roots = _forward(run, tables, kind, request, threshold, inputs)
    root = roots.get((), [])
    size, inf = request.size, tables.weights.inf
    best = root[size] if len(root) > size else inf
    if best >= inf >> 1:
        return None
    counts: dict[int, int] = {}
    stack: list[tuple[int, State, int]] = [(0, (), size)]
    while stack:
        node, state, k = stack.pop()
        for merge in reversed(run.merges[node]):
            if not k:
                break
            before, item_state, take = merge.source(state, k)
            if take:
                if merge.is_class:
                    counts[merge.item] = take
                else:
                    stack.append((merge.item, item_state, take))
            state, k = before, k - take
    return best, counts


# Kept whole on purpose (a listed lint exception): this is the readable
# specification _foldc.c follows step by step, and the twin tests compare
# them on thousands of cases; split, it would no longer read side by side.
def _forward(  # noqa: PLR0915
    run: _Fold,
    tables: FoldTables,
    kind: KindTables,
    request: Request,
    threshold: int,
    inputs: Inputs,
) -> Table:
    """Bottom up: each node's table from its items'; the root's table."""
    t = tables.topology
    cap, partner, other = inputs.cap, inputs.partner, inputs.other
    inf = tables.weights.inf
    prune_above = tables.prune_above(request, threshold)
    cover_unit = tables.cover_units(request, threshold)
    class_tables: list[Table] = [{} for _ in t.classes]
    total = 0
    for c in kind.classes:
        class_tables[c] = table = run.class_table(c, inputs, prune_above)
        total += _width(table)
    node_tables: list[Table] = [{} for _ in t.nodes]
    # Per node: free devices (both kinds), partners, and how many the
    # classes below it could take at most.
    free = [0] * len(t.nodes)
    targets = [0] * len(t.nodes)
    capacity = [0] * len(t.nodes)
    finish = kind.finish
    for fold_node in kind.walk:
        node = fold_node.node
        unit = cover_unit[fold_node.level]
        current: Table = {(): NOTHING}
        # `shift`: added to every count (items that take nothing whatever
        # happens); `zero`: the value when the whole node takes nothing,
        # its partners then covered further up, not here.
        zero = shift = below = room = waiting = 0
        merges = run.merges[node]
        for step in run.steps(node, fold_node.children, fold_node.mine):
            if step.is_class:
                table, pending = class_tables[step.item], 0
                more = _width(table)
                room += cap[step.item]
                if table.keys() == {()} and table[()] is NOTHING:
                    continue  # a class that can take nothing: no term, no merge
            else:
                table, pending = node_tables[step.item], targets[step.item]
                more = capacity[step.item]
                room += free[step.item]
            zero_state = next((s for s in table if not any(s)), None)
            nothing = table[zero_state] if zero_state is not None else None
            first = nothing[0] if nothing is not None else inf
            zero += first
            if pending:
                waiting += pending
                if zero_state is not None and nothing is not None:
                    # When this child takes nothing, its partners are covered here.
                    table = {**table, zero_state: [first + pending * unit, *nothing[1:]]}
            if table.keys() == {()} and len(table[()]) == 1:
                shift += table[()][0]
                continue
            below += more
            current = run.merge(step, current, table, total - below, merges)
        for c in fold_node.others:
            room += other[c]
            if partner[c]:
                waiting += partner[c]
                shift += partner[c] * unit
        free[node], targets[node], capacity[node] = room, waiting, below
        ends = finish[node]
        end: list[int] | None = None
        if ends is not None:
            end = ends[room]
            if end is None:
                end = tables.finish_row(kind, node, room)
                if len(end) <= FINISH_CACHED:
                    ends[room] = end
        done: Table = {}
        for state, merged in current.items():
            row = list(map(add, merged, repeat(shift))) if shift else merged
            if not any(state) and row[0] != zero:
                row = [zero, *row[1:]]
            done[state] = list(map(add, row, end)) if end is not None else row
        node_tables[node] = done
    return node_tables[0]


def _width(table: Table) -> int:
    """How many an item could take at most."""
    return max((len(row) - 1 for row in table.values()), default=0)
