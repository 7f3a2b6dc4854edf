"""The node core every front-end shares: discovery and health (the check loop,
with hardware reads under deadlines), the judge and what each resource
serves, holdings (ledger, PodResources, alignment), pairing, per-container
hooks and cleanup, metrics and the status endpoint."""
