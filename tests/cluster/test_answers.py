"""Per-node answers kept across calls (extender/answers.py): caught up by the
change log, expired by time, never older than the state a call began with."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Sequence

from devplugin.extender.answers import Answers, ChangeLog


def test_the_log_names_the_nodes_changed_since_a_mark_and_says_when_it_cannot() -> None:
    log = ChangeLog(length=4)
    start = log.mark
    assert log.since(start) == set()
    for name in ("a", "b", "a"):
        log.changed(name)
    assert log.since(start) == {"a", "b"}
    middle = log.mark
    log.changed("c")
    assert log.since(middle) == {"c"}
    log.changed("d")
    log.changed("e")
    assert log.since(start) is None  # five changes, four remembered
    assert log.since(middle) == {"c", "d", "e"}
    before = log.mark
    log.changed_everything()
    assert log.since(before) is None
    assert log.since(log.mark) == set()


class Counting:
    """A compute function over a state map, counting the names it was given."""

    def __init__(self, state: dict[str, int]) -> None:
        self.state = state
        self.asked: list[str] = []

    def __call__(self, names: Sequence[str]) -> dict[str, tuple[int, float]]:
        self.asked.extend(names)
        return {name: (self.state[name], math.inf) for name in names}


def test_only_the_nodes_named_since_the_last_call_are_worked_out_again() -> None:
    log = ChangeLog()
    answers: Answers[int] = Answers(log)
    state = {name: 0 for name in "abcd"}
    compute = Counting(state)
    found, kept = answers.read("k", list(state), compute)
    assert found == state
    assert kept == 0
    assert sorted(compute.asked) == ["a", "b", "c", "d"]
    compute.asked.clear()
    state["b"] = 1
    log.changed("b")
    found, kept = answers.read("k", list(state), compute)
    assert found["b"] == 1
    assert kept == 3
    assert compute.asked == ["b"]
    # Another question keeps its own table.
    compute.asked.clear()
    answers.read("other", ["a"], compute)
    assert compute.asked == ["a"]


def test_a_log_that_ran_past_a_tables_mark_starts_the_table_over() -> None:
    log = ChangeLog(length=2)
    answers: Answers[int] = Answers(log)
    state = {name: 0 for name in "abc"}
    compute = Counting(state)
    answers.read("k", list(state), compute)
    compute.asked.clear()
    for name in "abc":
        state[name] += 1
        log.changed(name)
    found, kept = answers.read("k", list(state), compute)
    assert kept == 0
    assert found == state


def test_an_answer_that_goes_stale_with_time_is_dropped_when_it_does() -> None:
    now = [100.0]
    log = ChangeLog()
    answers: Answers[str] = Answers(log, clock=lambda: now[0])
    asked: list[str] = []

    def compute(names: Sequence[str]) -> dict[str, tuple[str, float]]:
        asked.extend(names)
        # "lease" is fresh until 105 (then it answers otherwise), "static" for good.
        return {
            name: ("live" if now[0] < 105 else "stale", 105.0 if now[0] < 105 else math.inf)
            if name == "lease"
            else ("static", math.inf)
            for name in names
        }

    assert answers.read("k", ["lease", "static"], compute)[0] == {
        "lease": "live",
        "static": "static",
    }
    now[0] = 104.9
    assert answers.read("k", ["lease", "static"], compute)[1] == 2
    now[0] = 105.0
    asked.clear()
    found, kept = answers.read("k", ["lease", "static"], compute)
    assert found["lease"] == "stale"
    assert kept == 1
    assert asked == ["lease"]


def test_a_partial_computation_leaves_out_what_it_did_not_answer() -> None:
    log = ChangeLog()
    answers: Answers[int] = Answers(log)

    state = {"a": 1, "b": 2}

    def first_only(names: Sequence[str]) -> dict[str, tuple[int, float]]:
        return {names[0]: (state[names[0]], math.inf)} if names else {}

    found, kept = answers.read("k", ["a", "b"], first_only, partial=True)
    assert len(found) == 1
    assert kept == 0
    # What was answered is kept; the rest is asked again.
    again = Counting(state)
    found, kept = answers.read("k", ["a", "b"], again, partial=True)
    assert found == state
    assert kept == 1
    assert len(again.asked) == 1


def test_tables_past_the_limit_go_least_recently_asked_first() -> None:
    log = ChangeLog()
    answers: Answers[int] = Answers(log, tables=2)
    compute = Counting({"a": 0})
    answers.read("one", ["a"], compute)
    answers.read("two", ["a"], compute)
    answers.read("one", ["a"], compute)
    answers.read("three", ["a"], compute)  # "two" goes
    compute.asked.clear()
    assert answers.read("one", ["a"], compute)[1] == 1
    assert answers.read("two", ["a"], compute)[1] == 0


def test_under_churn_no_call_returns_an_answer_older_than_the_state_it_began_with() -> None:
    # Writers change a node's state, then name it in the log (as the caches
    # do: after the map holds the change); readers on several threads ask
    # at the same time. Each state only grows, so an answer below the value
    # a node had, logged, when the call began is one kept past its change.
    log = ChangeLog(length=64)
    answers: Answers[int] = Answers(log)
    names = [f"n{i}" for i in range(40)]
    state = dict.fromkeys(names, 0)
    logged = dict(state)
    lock = threading.Lock()
    stop = threading.Event()
    stale: list[tuple[str, int, int]] = []

    def compute(asked: Sequence[str]) -> dict[str, tuple[int, float]]:
        found = {name: (state[name], math.inf) for name in asked}
        time.sleep(0.0005)  # a slow walk: writers go on meanwhile
        return found

    def write(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            name = rng.choice(names)
            with lock:
                state[name] += 1
                value = state[name]
            log.changed(name)
            with lock:
                logged[name] = max(logged[name], value)

    def read(key: str) -> None:
        for _ in range(300):
            with lock:
                began = dict(logged)
            found, _ = answers.read(key, names, compute)
            stale.extend((n, found[n], began[n]) for n in names if found[n] < began[n])

    writers = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    readers = [threading.Thread(target=read, args=(key,)) for key in ("k", "k", "j")]
    for thread in writers + readers:
        thread.start()
    for thread in readers:
        thread.join()
    stop.set()
    for thread in writers:
        thread.join()
    assert stale == []
    assert answers.read("k", names, compute)[0] == state
