"""Kubernetes-facing parts: what the daemon learns from the API server."""
