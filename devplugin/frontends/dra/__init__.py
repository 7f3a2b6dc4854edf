"""The kubelet's Dynamic Resource Allocation plugin API and ResourceSlices:
the second way into the node core (discovery, health, hooks, checkpoint,
cleanup before reuse), beside the device-plugin front-end."""
