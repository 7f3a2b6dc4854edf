"""No exception in a loop is logged twice: a loop that ends by an error logs
it once (not again through the thread's hook), and a failure met again and
again (a retried cleanup, a listener failing at every event) logs its
traceback once, then at debug, and in full again after it worked."""

from __future__ import annotations

import logging
import threading

import pytest

from devplugin.loops import FailureLog, ThreadLoop


class _Broken(ThreadLoop):
    def run(self) -> None:
        raise RuntimeError("the loop broke")


def test_a_loop_ended_by_an_error_logs_it_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    hooked: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)
    loop = _Broken("broken")
    with caplog.at_level(logging.INFO):
        loop.start()
        loop.join(5.0)
    assert loop.thread is not None
    assert not loop.thread.is_alive()
    ended = [r for r in caplog.records if "ended by an error" in r.getMessage()]
    assert len(ended) == 1
    assert ended[0].exc_info is not None
    assert hooked == []  # not printed a second time by the thread's hook
    assert any("broken loop stopped" in r.getMessage() for r in caplog.records)


def _fail(failures: FailureLog, where: str, text: str) -> None:
    try:
        raise OSError(text)
    except OSError:
        failures.failed(where, "cleanup of %s failed", where)


def test_the_same_failure_is_logged_in_full_once_per_place(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("test.failures")
    failures = FailureLog(log)
    with caplog.at_level(logging.DEBUG, logger="test.failures"):
        for _ in range(5):
            _fail(failures, "gpu0", "busy")
        _fail(failures, "gpu1", "busy")  # another place: its own first
        _fail(failures, "gpu0", "gone")  # another message: in full
        failures.ok("gpu0")
        _fail(failures, "gpu0", "gone")  # after it worked: in full again
    full = [(r.getMessage(), r.levelno) for r in caplog.records if r.exc_info is not None]
    assert full == [
        ("cleanup of gpu0 failed", logging.ERROR),
        ("cleanup of gpu1 failed", logging.ERROR),
        ("cleanup of gpu0 failed", logging.ERROR),
        ("cleanup of gpu0 failed", logging.ERROR),
    ]
    repeats = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(repeats) == 4
    assert all("again: OSError: busy" in r.getMessage() for r in repeats)
