"""Which boot of the node this is: the kernel's random boot id.

The checkpoint outlives a reboot (it lives in /var/lib), but what a prepared
claim left behind does not: its CDI spec lived in /var/run/cdi, and its
devices were reset. A claim completed in another boot is prepared again.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

BOOT_ID = "/proc/sys/kernel/random/boot_id"
# A boot id is a UUID (36 characters); anything longer is not one.
_MAX = 64


def read_boot_id(path: Path) -> str:
    """The boot id in `path`, or "" when it cannot be read (then only a
    claim's spec file tells whether it survived: one that is gone is
    prepared again)."""
    try:
        with open(path, "rb") as handle:
            text = handle.read(_MAX + 1).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        log.warning(
            "boot id not read from %s (%s); a reboot is seen by the claims' CDI specs being gone",
            path,
            exc,
        )
        return ""
    if not text or len(text) > _MAX:
        log.warning(
            "%s holds no boot id; a reboot is seen by the claims' CDI specs being gone", path
        )
        return ""
    return text
