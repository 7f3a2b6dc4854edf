"""Small readers the wings share when they read a recorded device back."""

from __future__ import annotations

from devplugin.kinds.base import PictureError


def text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise PictureError(f"{what}: expected a string, got {type(value).__name__}")
    return value


def short(uuid: str) -> str:
    """A GPU or MIG UUID short enough for a box, still telling them apart
    (their last characters differ)."""
    return uuid if len(uuid) <= 24 else f"{uuid[:10]}…{uuid[-10:]}"
