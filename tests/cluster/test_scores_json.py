"""Prioritize answers joined from kept pieces (scores_json.py) read back as
the list json.dumps would write; ranks over a sequence as over a mapping."""

from __future__ import annotations

import json
import random
import threading

import pytest

from devplugin.extender.scores_json import HostScores
from devplugin.policy.ranking import rank_list, rank_scores


def test_encoded_scores_read_back_as_the_host_priority_list() -> None:
    rng = random.Random(3)
    alphabet = 'abz-.09"\\\n\u00e9\u2603'
    encoder = HostScores(limit=64)  # small: the keep starts over now and then
    for _ in range(300):
        names = ["".join(rng.choices(alphabet, k=rng.randrange(1, 12))) for _ in range(20)]
        names = rng.sample(names, rng.randrange(0, len(names) + 1))
        scores = [rng.randrange(0, 11) for _ in names]
        expected = [{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)]
        assert json.loads(encoder.encode(names, scores)) == expected


def test_names_and_scores_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="2 names but 1 scores"):
        HostScores().encode(["a", "b"], [1])


def test_threads_sharing_one_encoder_each_get_their_own_answer() -> None:
    encoder = HostScores(limit=300)
    wrong: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(200):
            names = [f"n{rng.randrange(1000)}" for _ in range(30)]
            scores = [rng.randrange(11) for _ in names]
            got = json.loads(encoder.encode(names, scores))
            if got != [{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)]:
                wrong.append(f"seed {seed}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_ranks_over_a_sequence_match_ranks_over_a_mapping() -> None:
    rng = random.Random(5)
    for _ in range(200):
        keys = [
            None if rng.random() < 0.2 else (rng.randrange(3), rng.randrange(4))
            for _ in range(rng.randrange(0, 30))
        ]
        by_name = rank_scores({f"n{i}": key for i, key in enumerate(keys)})
        assert rank_list(keys) == [by_name[f"n{i}"] for i in range(len(keys))]
    assert rank_list([(1, 0), None, (0, 0), (1, 0)]) == [9, 0, 10, 9]


def test_scores_past_the_ranking_s_range_are_written_too() -> None:
    answer = HostScores().encode(["a", "b"], [0, 100])
    assert json.loads(answer) == [{"Host": "a", "Score": 0}, {"Host": "b", "Score": 100}]
