"""The ResourceSlice (`resource.k8s.io/v1`) as the API server serves it:
the DRA driver publishes its devices in them, the extender reads them.
GROUP and VERSION are the DRA API's, which its claims and device classes
share (the API client classes: wire/resources.py)."""

from __future__ import annotations

GROUP, VERSION = "resource.k8s.io", "v1"
API_VERSION = f"{GROUP}/{VERSION}"

# A device's string attribute holds at most this many characters.
MAX_STRING = 64

_BINARY = ("Mi", "Gi", "Ti", "Pi", "Ei")


def string_value(value: str) -> dict[str, str]:
    """A string attribute, cut to what the API takes."""
    return {"string": value[:MAX_STRING]}


def mebibytes(count: int) -> str:
    """A quantity in the API server's canonical form, so what it stores is
    what was written (81920 MiB is stored as "80Gi", never "81920Mi")."""
    unit = 0
    while count and count % 1024 == 0 and unit < len(_BINARY) - 1:
        count //= 1024
        unit += 1
    return f"{count}{_BINARY[unit]}"
