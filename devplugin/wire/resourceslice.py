"""The ResourceSlice (`resource.k8s.io/v1`) as the API server serves it:
the DRA driver publishes its devices in them, the extender reads them
(the API client class: wire/resources.py)."""

from __future__ import annotations

GROUP, VERSION = "resource.k8s.io", "v1"
API_VERSION = f"{GROUP}/{VERSION}"
