"""A prioritize answer (the extender protocol's HostPriorityList) as JSON
bytes, joined from kept per-node pieces.

`json.dumps` of 500 `{"Host": ..., "Score": ...}` objects took half a
millisecond, as long as working the answer out; the scheduler waits for
it on every pod. Each node's `{"Host":"<name>","Score":` piece is encoded
once and kept (node names come back call after call), so an answer is
one join of kept pieces and score digits.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

# Pieces kept at most (a node name each); past it the keep starts over.
MAX_PIECES = 1 << 17


# Scores the ranking gives (0-10), with the comma after them, written once.
_SCORES = {score: f"{score}}}," for score in range(11)}


class HostScores:
    """Encodes HostPriorityLists; safe to share between threads."""

    def __init__(self, limit: int = MAX_PIECES) -> None:
        self._limit = limit
        self._pieces: dict[str, str] = {}
        self._lock = threading.Lock()

    def encode(self, names: Sequence[str], scores: Sequence[int]) -> bytes:
        """`[{"Host": names[i], "Score": scores[i]}, ...]` as JSON."""
        if len(names) != len(scores):
            raise ValueError(f"{len(names)} names but {len(scores)} scores")
        if not names:
            return b"[]"
        pieces = self._pieces
        try:
            heads = list(map(pieces.__getitem__, names))
        except KeyError:
            heads = self._learn(names)
        # Pieces and score texts interleaved, one join: no string per node.
        parts: list[str] = [""] * (2 * len(heads))
        parts[::2] = heads
        try:
            parts[1::2] = map(_SCORES.__getitem__, scores)
        except KeyError:  # a score the ranking never gives
            parts[1::2] = [f"{int(score)}}}," for score in scores]
        parts[-1] = parts[-1][:-1] + "]"
        return ("[" + "".join(parts)).encode()

    def _learn(self, names: Sequence[str]) -> list[str]:
        with self._lock:
            pieces = self._pieces
            if len(pieces) + len(names) > self._limit:
                pieces = self._pieces = {}
            for name in names:
                if name not in pieces:
                    pieces[name] = '{"Host":' + json.dumps(name) + ',"Score":'
            return list(map(pieces.__getitem__, names))
