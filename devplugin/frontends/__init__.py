"""The ways into the node core: each front-end speaks one kubelet protocol
(today the device-plugin API; Dynamic Resource Allocation next) over the
same discovery, health, hooks, holdings and policy."""
