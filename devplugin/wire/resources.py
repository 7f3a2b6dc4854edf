"""The API client's classes for the wire objects: loaded only by the parts
that talk to the API server, so a daemon without the API never loads the
client library."""

from __future__ import annotations

from lightkube.generic_resource import create_global_resource, create_namespaced_resource

from devplugin.wire import nodedevices, resourceslice

NodeDevices = create_global_resource(
    nodedevices.GROUP, nodedevices.VERSION, nodedevices.KIND, nodedevices.PLURAL
)
ResourceSlice = create_global_resource(
    resourceslice.GROUP, resourceslice.VERSION, "ResourceSlice", "resourceslices"
)
DeviceClass = create_global_resource(
    resourceslice.GROUP, resourceslice.VERSION, "DeviceClass", "deviceclasses"
)
ResourceClaim = create_namespaced_resource(
    resourceslice.GROUP, resourceslice.VERSION, "ResourceClaim", "resourceclaims"
)
