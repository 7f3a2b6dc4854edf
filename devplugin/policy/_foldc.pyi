from collections.abc import Sequence

class Tables:
    def __init__(
        self,
        nnodes: int,
        walk: Sequence[tuple[int, int, Sequence[int], Sequence[int], Sequence[int]]],
        class_values: Sequence[Sequence[Sequence[int]] | None],
        finish: Sequence[Sequence[Sequence[int]] | None],
        inf: int,
    ) -> None: ...
    def fold(
        self,
        cap: list[int],
        must: list[int],
        cost: list[int],
        partner: list[int],
        other: list[int],
        size: int,
        prune: int,
        cover_unit: Sequence[int],
    ) -> tuple[int, dict[int, int]] | None: ...
