"""Events from the kubelet's device-plugin directory (Linux inotify, through
libc): a kubelet that restarts removes the sockets there and creates its
own again, and the registrar should hear of it at once rather than at its
next poll. Where inotify is not there (another kernel, a libc without it,
no watches left), nothing is watched: the registrar's poll is the net
under these events either way."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import select
import struct
from collections.abc import Callable
from pathlib import Path

from devplugin.loops import ThreadLoop

log = logging.getLogger(__name__)

# inotify(7).
IN_ATTRIB = 0x004
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_CLOEXEC = 0o2000000
IN_NONBLOCK = 0o4000
MASK = (
    IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
)


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None
    return libc


class DirWatch(ThreadLoop):
    """Calls `changed()` (on its own thread) after entries of `directory`
    are created, removed, renamed or changed; the directory itself going
    away ends the watch (the caller's poll goes on)."""

    def __init__(self, directory: Path, changed: Callable[[], None]) -> None:
        super().__init__("plugin-dir-watch", join_timeout=1.0)
        self._directory = directory
        self._changed = changed
        self._fd: int | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    @property
    def watching(self) -> bool:
        return self._fd is not None

    def start(self) -> None:
        libc = _libc()
        fd = libc.inotify_init1(IN_CLOEXEC | IN_NONBLOCK) if libc is not None else -1
        if libc is None or fd < 0:
            log.info("no inotify here: the kubelet's directory is polled only")
            self._close_pipe()
            return
        path = os.fsencode(self._directory)
        if libc.inotify_add_watch(fd, path, MASK) < 0:
            why = os.strerror(ctypes.get_errno() or errno.EINVAL)
            log.info("%s not watched (%s): polled only", self._directory, why)
            os.close(fd)
            self._close_pipe()
            return
        self._fd = fd
        super().start()

    def run(self) -> None:
        fd = self._fd
        assert fd is not None
        while not self.stopping:
            ready, _, _ = select.select([fd, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            gone = False
            try:
                while True:
                    data = os.read(fd, 65536)
                    if not data:
                        break
                    gone |= _self_gone(data)
            except BlockingIOError:
                pass
            self._changed()
            if gone:
                log.info("%s went away: polled only from now", self._directory)
                return

    def signal_stop(self) -> None:
        super().signal_stop()
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    def finished(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._close_pipe()

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1


# struct inotify_event: wd, mask, cookie, len, then `len` bytes of name.
_EVENT = struct.Struct("iIII")


def _self_gone(data: bytes) -> bool:
    """Whether these events say the watched directory itself is gone."""
    offset = 0
    while offset + _EVENT.size <= len(data):
        _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
            return True
        offset += _EVENT.size + length
    return False
