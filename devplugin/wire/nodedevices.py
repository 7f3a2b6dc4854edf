"""The NodeDevices record (`nodedevices.devplugin.io/v1alpha1`): its
identity on the API server and the bounds its writer keeps.

One record per node, cluster-scoped, named after the node; the CRD in the
chart (crds/nodedevices.yaml) describes the same fields. No API client is
loaded here: a daemon without the API reads these bounds too
(wire/resources.py holds the client classes).
"""

from __future__ import annotations

GROUP, VERSION, KIND, PLURAL = "devplugin.io", "v1alpha1", "NodeDevices", "nodedevices"
API_VERSION = f"{GROUP}/{VERSION}"
# A reason or message in the record is cut to this many characters.
MAX_TEXT = 256
# Ports listed per HCA at most (the CRD's limit).
MAX_PORTS = 16
