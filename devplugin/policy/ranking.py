"""Scores from rank keys: the one rule both kinds of placement answers
(extended-resource pods and ResourceClaims) are scored by."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

# A rank key: compared as a tuple, lower is better.
K = TypeVar("K", bound=tuple[int, ...])


def rank_scores(keys: Mapping[str, K | None], top: int = 10) -> dict[str, int]:
    """Per name, `top` for the best (lowest) key, each worse distinct key
    one less (down to 1), and 0 for no key."""
    ordered = sorted({key for key in keys.values() if key is not None})
    rank: dict[K | None, int] = {key: max(1, top - index) for index, key in enumerate(ordered)}
    rank[None] = 0
    return {name: rank[key] for name, key in keys.items()}
