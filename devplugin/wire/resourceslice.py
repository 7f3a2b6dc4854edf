"""The ResourceSlice (`resource.k8s.io/v1`) as the API server serves it:
the DRA driver publishes its devices in them, the extender reads them.
GROUP and VERSION are the DRA API's, which its claims and device classes
share (the API client classes: wire/resources.py)."""

from __future__ import annotations

GROUP, VERSION = "resource.k8s.io", "v1"
API_VERSION = f"{GROUP}/{VERSION}"
