"""Reads with deadlines run on a small shared pool: threads do not grow with
devices, and a wedged read is still caught and never holds up the others."""

from __future__ import annotations

import sys
import threading

import pytest

from devplugin.node.deadline import POOL, Deadlines, Stuck
from tests.waiting import wait_until


def test_sixty_four_devices_are_read_on_the_same_few_threads() -> None:
    deadlines = Deadlines(5.0)
    try:
        for _ in range(3):
            for device in range(64):
                assert deadlines.call(f"gpu{device}", lambda d=device: d * 2) == device * 2
        assert deadlines.threads <= POOL
    finally:
        deadlines.close()


def test_a_wedged_read_is_caught_holds_one_thread_and_others_go_on() -> None:
    deadlines = Deadlines(0.2)
    release = threading.Event()
    try:
        with pytest.raises(Stuck):
            deadlines.call("gpu3", release.wait)  # wedged: abandoned at the deadline
        # The same device again: refused at once, no second thread for it.
        with pytest.raises(Stuck):
            deadlines.call("gpu3", lambda: True)
        # Every other device is read as usual meanwhile.
        for device in range(16):
            assert deadlines.call(f"gpu{device}-ok", lambda: "fine") == "fine"
        assert wait_until(lambda: "gpu3" in deadlines.stuck(), timeout=2)
        assert deadlines.threads <= POOL + 1  # the wedged one, plus the pool
        release.set()  # the read returns: the device is read again
        assert wait_until(lambda: "gpu3" not in deadlines.stuck(), timeout=2)
        assert wait_until(lambda: _answers(deadlines, "gpu3"), timeout=2)
    finally:
        release.set()
        deadlines.close()


def _answers(deadlines: Deadlines, key: str) -> bool:
    try:
        return bool(deadlines.call(key, lambda: True))
    except Stuck:
        return False


def test_an_error_in_a_read_reaches_its_caller_and_the_pool_survives() -> None:
    deadlines = Deadlines(1.0)
    try:
        with pytest.raises(OSError, match="gone"):
            deadlines.call("hca0", lambda: (_ for _ in ()).throw(OSError("gone")))
        assert deadlines.call("hca0", lambda: 7) == 7
    finally:
        deadlines.close()


def test_a_key_read_again_at_once_is_free_and_needs_no_new_thread() -> None:
    # The check loop reads each key once per check, back to back with the
    # next check under load: the key must be free when its caller wakes
    # (it was once freed after, and a loaded node saw every HCA "stuck").
    deadlines = Deadlines(5.0)
    interval = sys.getswitchinterval()
    done = threading.Event()

    def busy() -> None:  # other threads wanting the interpreter, as on a loaded node
        while not done.is_set():
            sum(range(200))

    hogs = [threading.Thread(target=busy) for _ in range(2)]
    sys.setswitchinterval(1e-6)  # and thread switches as often as it makes them
    try:
        for hog in hogs:
            hog.start()
        for round_ in range(3000):
            assert deadlines.call("sysfs", lambda r=round_: r) == round_
        assert deadlines.threads <= POOL
    finally:
        sys.setswitchinterval(interval)
        done.set()
        for hog in hogs:
            hog.join()
        deadlines.close()


def test_a_batch_reads_in_order_and_a_wedged_read_holds_up_none_after_it() -> None:
    deadlines = Deadlines(0.3)
    release = threading.Event()
    try:
        calls = [
            ("hca0", lambda: "a"),
            ("hca1", lambda: (_ for _ in ()).throw(OSError("gone"))),
            ("hca2", release.wait),  # wedged
            ("hca3", lambda: "d"),
            ("hca4", lambda: "e"),
        ]
        first, error, wedged, *rest = deadlines.call_all(calls)
        assert first == "a"
        assert isinstance(error, OSError)
        assert isinstance(wedged, Stuck)
        assert wedged.key == "hca2"
        assert rest == ["d", "e"]  # read on another worker, in time
        # The wedged key stays refused until its read returns; the others are free.
        again = deadlines.call_all([("hca2", lambda: True), ("hca3", lambda: "d2")])
        assert isinstance(again[0], Stuck)
        assert again[1] == "d2"
        assert wait_until(lambda: "hca2" in deadlines.stuck(), timeout=2)
        release.set()
        assert wait_until(lambda: deadlines.call_all([("hca2", lambda: 1)]) == [1], timeout=2)
        assert deadlines.threads <= POOL + 1
    finally:
        release.set()
        deadlines.close()


def test_reads_queued_behind_a_slow_one_are_not_taken_for_wedged() -> None:
    # Each read may take most of the deadline; together they take far more.
    deadlines = Deadlines(0.5)
    seen: list[dict[str, float]] = []

    def slow(n: int) -> int:
        seen.append(deadlines.stuck())
        threading.Event().wait(0.2)
        return n

    try:
        calls = [(f"gpu{n}", lambda n=n: slow(n)) for n in range(5)]
        assert deadlines.call_all(calls) == [0, 1, 2, 3, 4]
        assert seen == [{}] * 5
    finally:
        deadlines.close()
